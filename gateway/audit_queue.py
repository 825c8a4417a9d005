"""Audit events from the request path go through a queue to a writer thread.

A request never waits for the audit database; the writer hands each event to the tenancy
audit log, which spools to disk while the database is away. Shutdown drains the queue.
"""

from __future__ import annotations

import logging
import queue
import threading

from tenancy.audit_chain import AuditRecord
from tenancy.audit_log import AuditLog

logger = logging.getLogger(__name__)
_STOP = object()
_MAX_BATCH = 256


class AuditQueue:
    def __init__(self, log: AuditLog) -> None:
        self._log = log
        self._queue: queue.Queue[object] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="prefixgate-audit", daemon=True)
        self._thread.start()

    def put(self, record: AuditRecord) -> None:
        self._queue.put(record)

    def drain(self, timeout: float = 30.0) -> None:
        """Write everything queued, then stop the writer."""
        self._queue.put(_STOP)
        self._thread.join(timeout)

    def join(self) -> None:
        """Wait until everything queued so far is written (tests, shutdown)."""
        self._queue.join()

    def _run(self) -> None:
        while True:
            batch = [self._queue.get()]
            # Whatever else is already waiting goes into the same transaction.
            while len(batch) < _MAX_BATCH:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stop = _STOP in batch
            records = [item for item in batch if isinstance(item, AuditRecord)]
            try:
                if records:
                    self._log.record_many(records)
            except Exception:  # the writer must outlive any single bad batch
                logger.exception("could not record %d audit events", len(records))
            finally:
                for _ in batch:
                    self._queue.task_done()
            if stop:
                return
