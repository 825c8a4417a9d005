"""The OpenAI-compatible API: request shapes, preparation, serving, streaming responses, n choices,
tool calls.
"""
