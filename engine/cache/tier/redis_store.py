"""The shared tier: sealed values in Redis, one store for every worker of a model.

Keys live under `<prefix>:tier:{<root>}`: the chain root (model, adapter, KV dtype, block
size) is part of every key, so two models never mix, and it is the key's hash tag, so a
Redis Cluster keeps one tier in one slot (the lock and the transactions need that).
- `v:<id>`: an entry's sealed value (ids are keyed by their owner's data key: entry.py; an
  entry of an older format's id is never looked up again and ages out like any other);
- `meta` (hash): id -> "size value owner" (the value its priority is aged from);
- `z:<owner>` (sorted set): the owner's entry ids, scored by priority;
- `bytes`, `entries` (hashes): owner -> bytes and entries held;
- `budgets` (hash): owner -> "quota reserved", written by every worker that learns one;
- `clock`: the priority of the last entry evicted;
- `forgotten` (sorted set): owners deleted in the last week, whose puts are refused;
- `lock`: held around every change of the index.

A put takes the lock (`redis.lock.Lock`, a few seconds at most), reads a view of the index,
asks `plan_put` and applies its plan in one transaction: the one Python rule decides for every
worker. Reads take no lock: an entry evicted meanwhile is simply absent. Owners are written
by `owner_key` ("" for the public budget). Every Redis failure becomes `TierStoreError`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import redis
from redis.exceptions import RedisError

from engine.cache.block_hash import BlockHash
from engine.cache.budget import Owner
from engine.cache.eviction import aged_priority
from engine.cache.tier.store import (
    Candidate,
    Eviction,
    OwnerIndex,
    OwnerUsage,
    PutPlan,
    PutView,
    Refused,
    TierBudget,
    TierStoreError,
    decide,
    owner_from_key,
    owner_key,
    plan_put,
    plan_shrink,
)

# How long a forgotten owner's puts stay refused: far longer than any worker takes to hear of
# the deletion (each worker refuses them itself from then on).
FORGOTTEN_S = 7 * 24 * 3600.0

Result = TypeVar("Result")


class RedisStore:
    """A `TierStore` in Redis, shared by every worker with the same URL, prefix and root."""

    kind = "redis"

    def __init__(
        self,
        url: str,
        root: BlockHash,
        capacity_bytes: int,
        key_prefix: str = "prefixgate",
        default_budget: TierBudget | None = None,
        timeout_s: float = 1.0,
        lock_timeout_s: float = 10.0,
    ) -> None:
        self.capacity_bytes = capacity_bytes
        self.default_budget = default_budget or TierBudget(capacity_bytes)
        self._client: redis.Redis = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )
        self._base = f"{key_prefix}:tier:{{{root.hex()[:32]}}}"
        self._lock_timeout_s = lock_timeout_s

    # -- keys -----------------------------------------------------------------------------

    def _key(self, name: str) -> str:
        return f"{self._base}:{name}"

    def _value_key(self, entry_id: bytes) -> str:
        return f"{self._base}:v:{entry_id.hex()}"

    def _owner_set(self, owner: Owner) -> str:
        return f"{self._base}:z:{owner_key(owner)}"

    def _call(self, action: Callable[[], Result]) -> Result:
        try:
            return action()
        except RedisError as error:
            raise TierStoreError(f"redis tier: {error}") from error

    def _locked(self, action: Callable[[], Result]) -> Result:
        """Run `action` holding the store's lock: every change of the index goes through it."""

        def run() -> Result:
            lock = self._client.lock(
                self._key("lock"),
                timeout=self._lock_timeout_s,
                sleep=0.002,
                blocking_timeout=self._lock_timeout_s,
            )
            with lock:
                return action()

        return self._call(run)

    # -- reading the index (under the lock) ---------------------------------------------------

    def _view(
        self, owner: Owner, entry_id: bytes | None, wanted: frozenset[Owner], window: int
    ) -> PutView:
        pipe = self._client.pipeline(transaction=False)
        pipe.hgetall(self._key("bytes"))
        pipe.hgetall(self._key("entries"))
        pipe.hgetall(self._key("budgets"))
        pipe.get(self._key("clock"))
        pipe.zscore(self._key("forgotten"), owner_key(owner))
        pipe.hget(self._key("meta"), entry_id.hex() if entry_id is not None else "")
        held, counts, budgets, clock, forgotten, replaced_meta = pipe.execute()
        holders = {owner_from_key(k.decode()): int(v) for k, v in held.items() if int(v) > 0}
        holders.setdefault(owner, 0)
        lowest = self._lowest([o for o in holders if o in wanted], window) if window else {}
        owners = {}
        for holder, held_bytes in holders.items():
            key = owner_key(holder).encode()
            shown, complete = lowest.get(holder, ((), False))
            # A set shorter than the window is all there is, whatever the count says.
            entries = len(shown) if complete else int(counts.get(key, 0))
            budget = _read_budget(budgets.get(key)) or self.default_budget
            owners[holder] = OwnerIndex(held_bytes, entries, budget, shown)
        replaced = None
        if entry_id is not None and replaced_meta is not None:
            size, _, replaced_owner = _read_meta(replaced_meta)
            score = self._client.zscore(self._owner_set(replaced_owner), entry_id.hex())
            replaced = (replaced_owner, Candidate(entry_id, size, float(score or 0.0)))
        return PutView(
            self.capacity_bytes,
            sum(holders.values()),
            float(clock or 0.0),
            owners,
            replaced,
            forgotten is not None,
        )

    def _lowest(
        self, owners: Sequence[Owner], window: int
    ) -> dict[Owner, tuple[tuple[Candidate, ...], bool]]:
        """Each owner's `window` lowest-priority entries (lowest first, ties by id), and
        whether that is all of them."""
        pipe = self._client.pipeline(transaction=False)
        for owner in owners:
            pipe.zrange(self._owner_set(owner), 0, window - 1, withscores=True)
        ranked: list[list[tuple[bytes, float]]] = pipe.execute()
        ids = [member for members in ranked for member, _ in members]
        metas = self._metas(ids)
        sizes = {
            member: _read_meta(meta)[0] for member, meta in zip(ids, metas, strict=True) if meta
        }
        return {
            owner: (
                tuple(
                    Candidate(bytes.fromhex(member.decode()), sizes[member], score)
                    for member, score in members
                    if member in sizes
                ),
                len(members) < window,
            )
            for owner, members in zip(owners, ranked, strict=True)
        }

    def _metas(self, members: Sequence[bytes]) -> list[bytes | None]:
        """The `meta` of each entry id (as its hex member), None where there is none."""
        if not members:
            return []
        return cast(list[bytes | None], self._client.hmget(self._key("meta"), list(members)))

    # -- changing the index (in one transaction, under the lock) -------------------------------

    def _remove(self, pipe: Any, owner: Owner, entry_id: bytes, size: int) -> None:
        member = entry_id.hex()
        pipe.delete(self._value_key(entry_id))
        pipe.hdel(self._key("meta"), member)
        pipe.zrem(self._owner_set(owner), member)
        pipe.hincrby(self._key("bytes"), owner_key(owner), -size)
        pipe.hincrby(self._key("entries"), owner_key(owner), -1)

    def _apply_evictions(self, pipe: Any, plan: PutPlan) -> None:
        for eviction in plan.evictions:
            victim = eviction.victim
            self._remove(pipe, eviction.owner, victim.entry_id, victim.size)
        pipe.set(self._key("clock"), repr(plan.clock))

    # -- TierStore ----------------------------------------------------------------------------

    def charged_bytes(self, size: int) -> int:
        return size

    def put(self, entry_id: bytes, owner: Owner, sealed: bytes, value: float) -> PutPlan | Refused:
        """Store `sealed` after the evictions `plan_put` decides, under the lock."""

        def locked() -> PutPlan | Refused:
            view: PutView | None = None

            def read(wanted: frozenset[Owner], window: int) -> PutView:
                nonlocal view
                view = self._view(owner, entry_id, wanted, window)
                return view

            plan = decide(lambda v: plan_put(owner, len(sealed), value, v), read)
            if isinstance(plan, Refused):
                return plan
            assert view is not None
            pipe = self._client.pipeline(transaction=True)
            self._apply_evictions(pipe, plan)
            if view.replaced is not None:
                replaced_owner, replaced = view.replaced
                self._remove(pipe, replaced_owner, entry_id, replaced.size)
            member, key = entry_id.hex(), owner_key(owner)
            pipe.set(self._value_key(entry_id), sealed)
            pipe.hset(self._key("meta"), member, _meta(len(sealed), value, owner))
            pipe.zadd(self._owner_set(owner), {member: plan.priority})
            pipe.hincrby(self._key("bytes"), key, len(sealed))
            pipe.hincrby(self._key("entries"), key, 1)
            pipe.execute()
            return plan

        return self._locked(locked)

    def get_many(self, entry_ids: Sequence[bytes]) -> list[bytes | None]:
        if not entry_ids:
            return []
        keys = [self._value_key(entry_id) for entry_id in entry_ids]
        # Responses are bytes: the client never decodes them.
        return cast(list[bytes | None], self._call(lambda: self._client.mget(keys)))

    def contains(self, entry_ids: Sequence[bytes]) -> list[bool]:
        def run() -> list[bool]:
            pipe = self._client.pipeline(transaction=False)
            for entry_id in entry_ids:
                pipe.exists(self._value_key(entry_id))
            return [bool(found) for found in pipe.execute()]

        return self._call(run) if entry_ids else []

    def touch(self, entry_ids: Sequence[bytes], values: Sequence[float | None]) -> None:
        if not entry_ids:
            return

        def run() -> None:
            pipe = self._client.pipeline(transaction=False)
            pipe.get(self._key("clock"))
            pipe.hmget(self._key("meta"), [entry_id.hex() for entry_id in entry_ids])
            clock, metas = pipe.execute()
            pipe = self._client.pipeline(transaction=False)
            for entry_id, value, meta in zip(entry_ids, values, metas, strict=True):
                if meta is None:
                    continue
                _, stored_value, owner = _read_meta(meta)
                priority = aged_priority(
                    float(clock or 0.0), stored_value if value is None else value
                )
                # XX: an entry evicted since it was read stays gone.
                pipe.zadd(self._owner_set(owner), {entry_id.hex(): priority}, xx=True)
            pipe.execute()

        self._call(run)

    def delete(self, entry_ids: Sequence[bytes]) -> int:
        return self._locked(lambda: self._delete_held(entry_ids)) if entry_ids else 0

    def forget_owner(self, owner: Owner, limit: int) -> int:
        def locked() -> int:
            now = time.time()
            pipe = self._client.pipeline(transaction=True)
            pipe.zadd(self._key("forgotten"), {owner_key(owner): now})
            pipe.zremrangebyscore(self._key("forgotten"), "-inf", now - FORGOTTEN_S)
            pipe.hdel(self._key("budgets"), owner_key(owner))
            pipe.zrange(self._owner_set(owner), 0, limit - 1)
            members: list[bytes] = pipe.execute()[-1]
            if not members:
                self._client.hdel(self._key("bytes"), owner_key(owner))
                self._client.hdel(self._key("entries"), owner_key(owner))
                return 0
            self._delete_held([bytes.fromhex(m.decode()) for m in members], owner)
            return len(members)

        return self._locked(locked)

    def _delete_held(self, entry_ids: Sequence[bytes], owner: Owner | None = None) -> int:
        """Delete entries, holding the lock; a member of `owner`'s set whose entry is gone
        goes too."""
        metas = self._metas([e.hex().encode() for e in entry_ids])
        pipe = self._client.pipeline(transaction=True)
        held = 0
        for entry_id, meta in zip(entry_ids, metas, strict=True):
            if meta is not None:
                size, _, holder = _read_meta(meta)
                self._remove(pipe, holder, entry_id, size)
                held += 1
            elif owner is not None:
                pipe.zrem(self._owner_set(owner), entry_id.hex())
        pipe.execute()
        return held

    def set_budget(self, owner: Owner, budget: TierBudget) -> tuple[Eviction, ...]:
        def locked() -> tuple[Eviction, ...]:
            self._client.hset(
                self._key("budgets"),
                owner_key(owner),
                f"{budget.quota_bytes} {budget.reserved_bytes}",
            )
            plan = decide(
                lambda view: plan_shrink(owner, view),
                lambda wanted, window: self._view(owner, None, wanted, window),
            )
            assert isinstance(plan, PutPlan), "a shrink is never refused"
            if plan.evictions:
                pipe = self._client.pipeline(transaction=True)
                self._apply_evictions(pipe, plan)
                pipe.execute()
            return plan.evictions

        return self._locked(locked)

    def usage(self) -> dict[Owner, OwnerUsage]:
        def run() -> dict[Owner, OwnerUsage]:
            pipe = self._client.pipeline(transaction=False)
            pipe.hgetall(self._key("bytes"))
            pipe.hgetall(self._key("entries"))
            held, counts = pipe.execute()
            return {
                owner_from_key(key.decode()): OwnerUsage(int(size), int(counts.get(key, 0)))
                for key, size in held.items()
                if int(size) > 0
            }

        return self._call(run)

    def close(self) -> None:
        self._client.close()


def _meta(size: int, value: float, owner: Owner) -> bytes:
    return f"{size} {value!r} {owner_key(owner)}".encode()


def _read_meta(meta: bytes) -> tuple[int, float, Owner]:
    size, value, owner = meta.decode().split(" ", 2)
    return int(size), float(value), owner_from_key(owner)


def _read_budget(raw: bytes | None) -> TierBudget | None:
    if raw is None:
        return None
    quota, reserved = raw.split()
    return TierBudget(int(quota), int(reserved))
