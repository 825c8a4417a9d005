"""Audit events from the request path go through a queue to a writer thread.

A request never waits for the audit database; the writer hands each event to the tenancy
audit log, which spools to disk while the database is away. After it wrote new events, the
writer signs a checkpoint at least every `checkpoint_interval_s`, which bounds what someone
with write access to the database could cut from the chain's tail unnoticed. Shutdown drains
the queue.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

from tenancy.audit_chain import AuditRecord
from tenancy.audit_log import AuditLog

logger = logging.getLogger(__name__)
_STOP = object()
_MAX_BATCH = 256


class AuditQueue:
    def __init__(self, log: AuditLog, checkpoint_interval_s: float = 10.0) -> None:
        self._log = log
        self._checkpoint_interval_s = checkpoint_interval_s
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
        """Wait until everything queued so far is written (and checkpointed when due)."""
        self._queue.join()

    def _run(self) -> None:
        unsigned = False  # events written since the last checkpoint
        last_checkpoint = time.monotonic()
        while True:
            batch = self._next_batch(
                None if not unsigned else last_checkpoint + self._checkpoint_interval_s
            )
            stop = _STOP in batch
            records = [item for item in batch if isinstance(item, AuditRecord)]
            try:
                if records:
                    # True also when the database refused some (they are dead letters).
                    unsigned = self._log.record_many(records) or unsigned
                due = time.monotonic() - last_checkpoint >= self._checkpoint_interval_s
                if unsigned and (due or stop):
                    last_checkpoint = time.monotonic()
                    self._log.checkpoint_now()
                    unsigned = False
            except Exception:  # the writer must outlive any single bad batch or outage
                logger.exception("could not record %d audit events", len(records))
            finally:
                for _ in batch:
                    self._queue.task_done()
            if stop:
                return

    def _next_batch(self, checkpoint_due: float | None) -> list[object]:
        """What is queued (waiting for the first item until a checkpoint is due, if one is)."""
        timeout = None if checkpoint_due is None else max(0.0, checkpoint_due - time.monotonic())
        try:
            batch = [self._queue.get(timeout=timeout)]
        except queue.Empty:
            return []
        # Whatever else is already waiting goes into the same transaction.
        while len(batch) < _MAX_BATCH:
            try:
                batch.append(self._queue.get_nowait())
            except queue.Empty:
                break
        return batch
