"""The KV cache: block keys and scopes, the block pool, the prefix cache, owners and budgets, and
the manager that decides which blocks a request gets.
"""
