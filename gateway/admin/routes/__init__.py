"""The admin API under /admin/api: one module per resource, each with its own router, thin: each
calls the admin service and answers its JSON."""

from gateway.admin.routes import audit, auth, keys, operators, pools, prefixes, tenants, usage

ROUTERS = [
    router.router for router in (auth, tenants, keys, prefixes, operators, usage, pools, audit)
]
