"""The HTTP face every route shares: connections, the request gate and body limit, the request's
settlement, dependencies, OpenAPI, and the system routes.
"""
