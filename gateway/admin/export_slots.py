"""Export slots: how many audit exports are written at once, and by whom.

An export reads up to `MAX_EXPORT_EVENTS` events and writes them out; a few at once are
cheap, many at once starve the database for everyone. So at most `MAX_CONCURRENT_EXPORTS`
are written at a time in the process and one per holder, and a caller past that is told at
once to retry (a 429 `export_busy`), never queued.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from gateway.admin.callers import AdminCaller
from gateway.errors import APIError

MAX_CONCURRENT_EXPORTS = 2  # exports being written at once, in this process
EXPORT_RETRY_AFTER_S = 5  # seconds a refused export is told to wait before it retries


def export_holder(caller: AdminCaller) -> str:
    """Whose export slot a call takes: a tenant's administrators share one (however many
    tenant-admin keys they make), an admin operator has its own."""
    if caller.is_admin:
        return f"{caller.actor_type}:{caller.actor_id}"
    return f"tenant:{caller.tenant_id}"


class ExportSlots:
    """At most `total` exports written at once, and one per holder; no waiting in line."""

    def __init__(self, total: int) -> None:
        self._total = total
        self._lock = threading.Lock()
        self._holders: set[str] = set()

    @contextlib.contextmanager
    def hold(self, holder: str) -> Iterator[None]:
        """A slot for `holder` while the block runs; a 429 (export_busy) at once if none."""
        with self._lock:
            if holder in self._holders:
                raise _busy("an export of yours is still being written; retry when it is done")
            if len(self._holders) >= self._total:
                raise _busy(f"{self._total} exports are being written; retry shortly")
            self._holders.add(holder)
        try:
            yield
        finally:
            with self._lock:
                self._holders.discard(holder)


EXPORT_SLOTS = ExportSlots(MAX_CONCURRENT_EXPORTS)


def _busy(message: str) -> APIError:
    return APIError.rate_limited(message, retry_after=EXPORT_RETRY_AFTER_S, code="export_busy")
