"""The admin API under /admin/api: one module per resource, each with its own router."""

from gateway.api.routes.admin import audit, auth, keys, operators, pools, prefixes, tenants, usage

ROUTERS = [
    router.router for router in (auth, tenants, keys, prefixes, operators, usage, pools, audit)
]
