"""The second KV tier: blocks that leave a worker's pool, sealed per tenant, in a store.

`sealing` (AES-256-GCM values bound to root, block key and key id), `entry` (a block's
identity, entry id and plaintext), `store` (the store interface and `plan_put`, the one rule
for quotas, reservations and eviction by value), `disk_store` and `redis_store` (the two
backends), `counters` (what the tier did, per owner), `kv_tier` (the facade the engine
uses, and its calibration), `speed` (the load-or-recompute rule) and `backends` (a tier
from settings: `make_tier`).
"""
