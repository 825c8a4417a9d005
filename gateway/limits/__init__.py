"""Per-tenant request, token and concurrency limits: in this process, or shared by every
gateway through Redis (see limiter.py)."""
