"""The gateways serving this deployment: each reports itself to the database every `REPORT_S`,
so each can count the others and tell whether they share their limits.

A gateway that limits alone (no `redis_url`) and sees other gateways warns once, in one line:
each tenant gets its limits once per gateway. A gateway with shared limits that sees one
without warns once about that one: its tenants' requests there are counted apart.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from dataclasses import dataclass, field
from datetime import timedelta

from tenancy import deployment
from tenancy.deployment import GatewaySeen
from tenancy.store import Store

logger = logging.getLogger(__name__)
REPORT_S = 5.0
# A gateway that has not reported itself for this long is not counted.
LIVE_WITHIN = timedelta(seconds=30)


@dataclass
class Peers:
    """This gateway's report of itself, and what it last read of the others."""

    store: Store
    shared_limits: bool
    instance_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    live: list[GatewaySeen] = field(default_factory=list)
    _warned: set[str] = field(default_factory=set)

    def report(self) -> None:
        """Say this gateway runs, read the others, and warn about limits that are not shared.

        Blocking (the database): run it off the event loop.
        """
        with self.store.transaction() as session:
            deployment.report_gateway(
                session, self.instance_id, socket.gethostname(), os.getpid(), self.shared_limits
            )
            self.live = deployment.gateways_seen(session, LIVE_WITHIN)
        others = [seen for seen in self.live if seen.id != self.instance_id]
        if not self.shared_limits:
            if others and "alone" not in self._warned:
                self._warned.add("alone")
                logger.warning(
                    "%d other gateway(s) serve this database but PREFIXGATE_REDIS_URL is unset "
                    "here: each tenant gets its limits once per gateway; set it on every gateway",
                    len(others),
                )
            return
        for seen in others:
            if not seen.shared_limits and seen.id not in self._warned:
                self._warned.add(seen.id)
                logger.warning(
                    "gateway %s (pid %d) serves this database without PREFIXGATE_REDIS_URL: "
                    "tenants' requests there are not counted against their shared limits",
                    seen.hostname,
                    seen.pid,
                )

    def leave(self) -> None:
        """Take this gateway off the list (at shutdown)."""
        with self.store.transaction() as session:
            deployment.forget_gateway(session, self.instance_id)

    @property
    def count(self) -> int:
        """Gateways serving the deployment now, this one included."""
        return max(1, len(self.live))
