"""The gateways serving this deployment: each reports itself to the database every `REPORT_S`,
so each can count the others and tell whether they count tenants' limits in one place.

Each report names where the gateway counts limits: "" (its own process), or a digest of its
shared store (the Redis and the key prefix; `limits_store_id`). A gateway that limits alone
and sees other gateways warns once, in one line: each tenant gets its limits once per gateway.
A gateway with shared limits that sees one counting elsewhere (in its own process, or in
another Redis or under another key prefix) warns once about that one: its tenants' requests
there are counted apart.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import uuid
from dataclasses import dataclass, field
from datetime import timedelta

from gateway.limits.redis_store import redis_place
from tenancy import deployment
from tenancy.deployment import GatewaySeen
from tenancy.store import Store

logger = logging.getLogger(__name__)
REPORT_S = 5.0
# A gateway that has not reported itself for this long is not counted.
LIVE_WITHIN = timedelta(seconds=30)


def limits_store_id(redis_url: str | None, key_prefix: str) -> str:
    """Where a gateway counts limits, as its report names it: "" for its own process, else a
    digest of the Redis it uses (host, port, database or socket path) and its key prefix, so
    that two gateways agree exactly when they count in one place (a password is left out)."""
    if redis_url is None:
        return ""
    place = f"{redis_place(redis_url)}|{key_prefix}"
    return "redis:" + hashlib.sha256(place.encode()).hexdigest()[:32]


@dataclass
class Peers:
    """This gateway's report of itself, and what it last read of the others."""

    store: Store
    limits_store: str  # where this gateway counts limits (`limits_store_id`)
    instance_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    live: list[GatewaySeen] = field(default_factory=list)
    _warned: set[str] = field(default_factory=set)

    def report(self) -> None:
        """Say this gateway runs, read the others, and warn about limits counted apart.

        Blocking (the database): run it off the event loop.
        """
        with self.store.transaction() as session:
            deployment.report_gateway(
                session, self.instance_id, socket.gethostname(), os.getpid(), self.limits_store
            )
            self.live = deployment.gateways_seen(session, LIVE_WITHIN)
        others = [seen for seen in self.live if seen.id != self.instance_id]
        if not self.limits_store:
            if others and "alone" not in self._warned:
                self._warned.add("alone")
                logger.warning(
                    "%d other gateway(s) serve this database but PREFIXGATE_REDIS_URL is unset "
                    "here: each tenant gets its limits once per gateway; set it on every gateway",
                    len(others),
                )
            return
        for seen in others:
            if seen.limits_store != self.limits_store and seen.id not in self._warned:
                self._warned.add(seen.id)
                where = (
                    "without PREFIXGATE_REDIS_URL"
                    if not seen.limits_store
                    else "with another Redis or key prefix than this one"
                )
                logger.warning(
                    "gateway %s (pid %d) serves this database %s: tenants' requests there are "
                    "not counted against the limits they have here",
                    seen.hostname,
                    seen.pid,
                    where,
                )

    def leave(self) -> None:
        """Take this gateway off the list (at shutdown)."""
        with self.store.transaction() as session:
            deployment.forget_gateway(session, self.instance_id)

    @property
    def count(self) -> int:
        """Gateways serving the deployment now, this one included."""
        return max(1, len(self.live))
