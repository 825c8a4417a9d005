"""The workers a gateway routes to: who they are, what they serve, whether they answer, what
they hold.

Every request to a worker goes over the gateway's `WorkerLink` (link.py: mutual TLS, the
worker secret, and a signature on each admin action). A thread polls every worker each
`worker_poll_s`: it re-resolves `dns://` names (addresses.py),
reads each worker's model, load, cache statistics, cached keys' changes and report (tenants'
work, service, step times: activity.py), and keeps what it learnt of each (worker.py). A worker
of a model this gateway has not met yet is first introduced to it (models.py). A worker that
fails a poll or a connection is out of routing at once, and back after its next good poll,
which first gives it what it missed.

Workers hold no tenant state of their own, so every admin action goes to every worker. What a
worker must hold is never remembered by one gateway alone: it is the database's (`know_tenants`,
from the gateway's tenancy sync): every tenant's budget, and the tenants that were deleted. A
worker that comes back (to this gateway, or to a gateway that restarted meanwhile) gets every
budget, and a purge of every deleted tenant it still holds blocks of, before it is routed to;
and every poll purges a deleted tenant whose blocks a worker reports, however they got there.
Only a withdrawn public prefix a worker missed is remembered here, in memory: its blocks can no
longer be matched by anyone (no plan marks that text public any more) and age out of the cache.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from engine.cache.budget import Owner, TenantBudget
from gateway.workers import wire
from gateway.workers.activity import read_activity
from gateway.workers.addresses import parse_worker_spec, resolve
from gateway.workers.link import WorkerLink
from gateway.workers.models import ModelCatalog
from gateway.workers.worker import Worker

logger = logging.getLogger(__name__)

# A worker that discovery stopped naming is kept this long (with the changes it missed).
FORGET_UNLISTED_S = 3600.0
# Workers polled at once (more than this wait for a free poller within the round).
_POLLERS = 16


class WorkerRefused(ValueError):
    """A worker refused an admin change itself (a reservation its pool cannot hold)."""


class WorkerSet:
    """The workers named by the settings, polled on a thread of their own."""

    def __init__(
        self,
        specs: list[str],
        link: WorkerLink,
        poll_s: float,
        timeout_s: float,
        load_models: bool = True,
    ) -> None:
        """`load_models=False` only checks that workers answer (a probe before start-up)."""
        for spec in specs:
            parse_worker_spec(spec)
        self._specs = specs
        self._poll_s = poll_s
        self.timeout_s = timeout_s
        self.lock = threading.Lock()
        self.workers: dict[str, Worker] = {}
        # What every worker must hold, as the database said last (`know_tenants`).
        self._budgets: dict[Owner, TenantBudget] = {}
        self._deleted: frozenset[str] = frozenset()
        self._tenants_known = False
        self.version = 0  # moves whenever what a poll or a failure told of a worker changes
        self.link = link  # the scheme, TLS, secret and signer every request to a worker uses
        self._client = link.sync_client(timeout_s)
        self.models = ModelCatalog(self._client) if load_models else None
        self._pollers = ThreadPoolExecutor(_POLLERS, thread_name_prefix="prefixgate-poll")
        self._resolved: dict[str, list[str]] = {}  # the last good answer for each spec
        self._changes = 0  # admin changes so far, so a catch-up can tell it missed none
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.changed = threading.Condition(self.lock)  # notified after every poll round

    # -- polling ------------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="prefixgate-workers")
            self._thread.daemon = True
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.timeout_s + self._poll_s)
        self._pollers.shutdown(wait=True)
        self._client.close()
        if self.models is not None:
            self.models.close()

    def wait_for_any(self, timeout_s: float) -> bool:
        """Whether a worker answered within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        with self.changed:
            while not any(worker.up for worker in self.workers.values()):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.changed.wait(min(left, self._poll_s))
        return True

    def why_none(self) -> str:
        """Why no worker is up: each one's last error, or that none was found."""
        with self.lock:
            reasons = [f"{w.url}: {w.last_error or 'not ready'}" for w in self.workers.values()]
        return "; ".join(reasons) or f"no worker found at {', '.join(self._specs)}"

    def _loop(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self.poll_once()
            except Exception:  # never let one bad round end routing's view of the workers
                logger.exception("polling the engine workers failed")
            self._stop.wait(max(0.0, self._poll_s - (time.monotonic() - started)))

    def poll_once(self) -> None:
        """Resolve the workers, then read each one's state (one round)."""
        listed: list[str] = []
        for spec in self._specs:
            urls = resolve(spec, self.link.scheme)
            if urls is not None:
                self._resolved[spec] = urls
            listed += self._resolved.get(spec, [])
        now = time.monotonic()
        with self.lock:
            for url in listed:
                worker = self.workers.setdefault(url, Worker(url))
                worker.unlisted_since = None
            for url, worker in list(self.workers.items()):
                if url in listed:
                    continue
                if worker.unlisted_since is None:
                    # No new requests; kept (and told what it misses) in case the name lists
                    # it again. Its streams go on: a pod leaves DNS when it starts draining.
                    worker.unlisted_since = now
                    self._take_out(worker, "no longer listed")
                elif now - worker.unlisted_since > FORGET_UNLISTED_S and not worker.in_flight:
                    del self.workers[url]
            # An unlisted worker is still polled while this gateway has requests there.
            todo = [w for w in self.workers.values() if w.unlisted_since is None or w.in_flight]
        # Side by side: a worker that hangs until the timeout delays no other's poll.
        list(self._pollers.map(self._poll, todo))
        if self.models is not None:
            with self.lock:
                served = {worker.fingerprint for worker in self.workers.values()}
            self.models.forget_except(served)
        with self.changed:
            self.changed.notify_all()

    def _poll(self, worker: Worker) -> None:
        with self.lock:
            params: dict[str, str | int] = {"since": worker.seq, "epoch": worker.epoch or ""}
        try:
            response = self._client.get(f"{worker.url}/internal/v1/state", params=params)
            response.raise_for_status()
            state = response.json()
            stats = wire.read_stats(state["stats"])
            ready = bool(state["ready"])
            in_flight = int(state["in_flight"])
            keys = state["keys"]
            epoch, seq, full = str(keys["epoch"]), int(keys["seq"]), bool(keys["full"])
            added, removed = list(keys["added"]), list(keys["removed"])
            name, fingerprint = str(state["model"]), str(state["fingerprint"])
            activity = read_activity(state)  # lenient: a worker of the last version has none
        except httpx.TimeoutException as error:
            self.mark_down(worker, f"poll got no answer: {error!r}", silent=True)
            return
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as error:
            self.mark_down(worker, f"poll failed: {error!r}")
            return
        if self.models is not None:
            refused = self.models.adopt(worker.url, name, fingerprint)
            if refused is not None:
                self.mark_down(worker, refused)
                return
        with self.lock:
            if worker.fingerprint and fingerprint != worker.fingerprint:
                self._take_out(worker, "it serves another model now")  # restarted as another
            worker.model, worker.fingerprint = name, fingerprint
            if full or epoch != worker.epoch:
                worker.keys = set(added)
            else:
                worker.keys.difference_update(removed)
                worker.keys.update(added)
            if worker.epoch is not None and epoch != worker.epoch:
                # A new process: it knows no budget yet, and holds none of the keys sent there.
                self._take_out(worker, "restarted")
                worker.pending.clear()
            worker.epoch, worker.seq = epoch, seq
            worker.lost = worker.silent = False
            worker.reported_load = in_flight
            worker.own_at_poll = worker.in_flight
            worker.own_tenants_at_poll = dict(worker.tenant_in_flight)
            worker.activity = activity
            worker.forget_pending(time.monotonic())
            worker.free_blocks = stats.free_blocks
            worker.stats = stats
            worker.state = state
            self.version += 1
            held_deleted = self._deleted_held(worker)
            resync = worker.resync
            if not resync:
                self._set_up(worker, ready)
        if resync:
            self._catch_up(worker, ready)
        elif held_deleted:  # however they got there: a deleted tenant's blocks go at once
            self._purge_deleted(worker, held_deleted)

    def _deleted_held(self, worker: Worker) -> list[str]:
        """Deleted tenants the worker reports blocks of, in its pool or its tier (a disk tier
        reopened after a restart still lists entries it can no longer read) (locked)."""
        if worker.stats is None or not self._deleted:
            return []
        return [
            owner
            for owner, held in worker.stats.owners.items()
            if isinstance(owner, str)
            and owner in self._deleted
            and held.active_blocks + held.cached_blocks + held.tier_entries
        ]

    def _purge_deleted(self, worker: Worker, tenant_ids: list[str]) -> None:
        try:
            for tenant_id in tenant_ids:
                purged = self._post(worker, "purge", {"tenant_id": tenant_id}).get("blocks", 0)
                logger.info(
                    "purged %s blocks of deleted tenant %s on %s", purged, tenant_id, worker.url
                )
        except (httpx.HTTPError, ValueError) as error:
            self.mark_down(worker, f"could not purge a deleted tenant: {error!r}")

    def _catch_up(self, worker: Worker, ready: bool) -> None:
        """Give a worker that was away every budget, a purge of each deleted tenant it holds
        blocks of and the withdrawn prefixes it missed, then let it into routing; again if an
        admin change arrived meanwhile (none is ever lost)."""
        while True:
            with self.lock:
                seen = self._changes
                budgets = dict(self._budgets)
                purges = [("purge", {"tenant_id": t}) for t in self._deleted_held(worker)]
                missed = list(worker.missed)
            try:
                for path, body in [("budgets", _budgets_body(budgets)), *purges, *missed]:
                    try:
                        self._post(worker, path, body)
                    except WorkerRefused as error:  # the worker is fine; the change is not
                        logger.warning("worker %s refused %s: %s", worker.url, path, error)
            except (httpx.HTTPError, ValueError) as error:
                self.mark_down(worker, f"could not catch up: {error!r}")
                return
            with self.lock:
                del worker.missed[: len(missed)]
                if self._changes == seen:
                    worker.resync = False
                    self._set_up(worker, ready)
                    return

    def _set_up(self, worker: Worker, ready: bool) -> None:
        """In routing if it is ready and listed (locked; it has caught up)."""
        up = ready and worker.unlisted_since is None
        if up and not worker.up:
            logger.info("worker %s is up", worker.url)
            worker.last_error = ""  # it answers again: the reason it was out is past
        worker.up = up

    def mark_down(self, worker: Worker, why: str, silent: bool = False) -> None:
        """It failed to answer: out of routing until a poll succeeds and it has caught up.
        `silent` (it answered nothing in time) also ends the streams waiting on it."""
        with self.lock:
            self._lose(worker, why, silent)

    def _lose(self, worker: Worker, why: str, silent: bool = False) -> None:
        """`mark_down` under the lock already held."""
        self._take_out(worker, why)
        worker.lost = True
        self.version += 1
        worker.silent = worker.silent or silent  # a successful poll clears it

    def _take_out(self, worker: Worker, why: str) -> None:
        """No new requests, and caught up before it takes any again (locked)."""
        worker.last_error = why
        if worker.up:
            logger.warning("worker %s is out of routing: %s", worker.url, why)
        worker.up = False
        worker.resync = True

    # -- admin actions, on every worker -------------------------------------------------------

    def know_tenants(self, budgets: Mapping[Owner, TenantBudget], deleted: frozenset[str]) -> None:
        """What every worker must hold, as the database says now (called by the gateway's
        tenancy sync whenever tenancy changed, and once at start). The first time, every
        worker is given it at its next poll (it stays in routing meanwhile: each request
        carries its own tenant's budget)."""
        with self.lock:
            self._budgets, self._deleted = dict(budgets), deleted
            if not self._tenants_known:
                self._tenants_known = True
                self._changes += 1
                for worker in self.workers.values():
                    worker.resync = True

    def set_budget(self, owner: Owner, budget: TenantBudget) -> int:
        with self.lock:
            self._budgets[owner] = budget
            self._changes += 1
        return self._everywhere("budgets", _budgets_body({owner: budget}), remember=False)

    def purge(self, tenant_id: str) -> int:
        """Purge a tenant everywhere (a worker away now is purged when it catches up, as long as
        the database says the tenant is deleted)."""
        return self._everywhere("purge", {"tenant_id": tenant_id}, remember=False)

    def drop_public_prefix(
        self, namespace: str, token_ids: list[int], fingerprint: str | None = None
    ) -> int:
        """Drop a withdrawn prefix's public blocks on the workers of one model (all: None)."""
        body = {"namespace": namespace, "token_ids": token_ids}
        return self._everywhere("drop-public-prefix", body, remember=True, fingerprint=fingerprint)

    def _everywhere(
        self, path: str, body: dict[str, Any], remember: bool, fingerprint: str | None = None
    ) -> int:
        """Send an action to every worker (of `fingerprint`'s model, if given) that answers and
        has caught up (draining ones too); the blocks it freed, summed. Any other worker gets
        it when it catches up (a budget and a deleted tenant's purge come from the database's
        view then; `remember` keeps other actions for it), and is out of routing until then."""
        with self.lock:
            self._changes += 1
            workers = []
            for worker in self.workers.values():
                if fingerprint is not None and worker.fingerprint not in ("", fingerprint):
                    continue
                if not worker.lost and not worker.resync and worker.unlisted_since is None:
                    workers.append(worker)
                else:
                    if remember:
                        worker.missed.append((path, body))
                    worker.resync = True
        total = 0
        refused: WorkerRefused | None = None
        for worker in workers:
            try:
                total += int(self._post(worker, path, body).get("blocks", 0))
            except WorkerRefused as error:  # the same change fails on every worker
                refused = error
            except (httpx.HTTPError, ValueError) as error:
                with self.lock:  # one step, so a catch-up cannot slip in between
                    if remember:
                        worker.missed.append((path, body))
                    self._changes += 1
                    self._lose(worker, f"missed {path}: {error!r}")
        if refused is not None:
            raise refused
        return total

    def _post(self, worker: Worker, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST to a worker; `WorkerRefused` for a change it refuses (4xx), an httpx error
        when it cannot be reached or fails."""
        response = self._client.post(
            f"{worker.url}/internal/v1/{path}", json=body, headers=self.link.signed(path, body)
        )
        if response.status_code in (400, 422):
            raise WorkerRefused(_message(response))
        response.raise_for_status()
        result: dict[str, Any] = response.json()
        return result

    # -- what routing reads -------------------------------------------------------------------

    def routable(self) -> list[Worker]:
        with self.lock:
            return [worker for worker in self.workers.values() if worker.up]

    def snapshot(self, read: Callable[[Worker], Any]) -> list[Any]:
        """`read(worker)` for every worker, under the lock."""
        with self.lock:
            return [read(worker) for worker in self.workers.values()]


def _message(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return f"HTTP {response.status_code}"


def _budgets_body(budgets: dict[Owner, TenantBudget]) -> dict[str, Any]:
    return {
        "budgets": [
            {"owner": wire.owner_json(owner), "budget": wire.budget_json(budget)}
            for owner, budget in budgets.items()
        ]
    }
