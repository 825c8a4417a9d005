"""The engine thread and its inbox: how other threads hand it work.

Everything that touches the KV cache runs on one thread, one step at a time. Other threads never
call into the cache: they `post` an action (accept a request, cancel one) or `call` one and wait
for its result, and the engine thread runs every queued action, in order, at the start of its
next step (`drain`). When no thread runs (tests drive `step` by hand), `call` runs its action
at once, after whatever was queued before it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

T = TypeVar("T")
Action = Callable[[], None]
# How long an idle thread sleeps before it looks again (a notify wakes it sooner).
_IDLE_WAIT_S = 0.5


class Inbox:
    """Actions queued for the engine thread, and the thread that runs them between steps."""

    def __init__(self) -> None:
        # Guards the queue and the stop flag. The engine keeps its registry of requests in flight
        # under it too, so that a new request is either refused or queued before a stop, never
        # lost in between.
        self.lock = threading.Condition()
        self._actions: list[Action] = []
        self._stopping = False
        self._thread: threading.Thread | None = None

    @property
    def stopping(self) -> bool:
        """Whether `stop` was called (and `start` not since)."""
        return self._stopping

    @property
    def running(self) -> bool:
        """Whether the engine thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def start(self, step: Callable[[], object], has_work: Callable[[], bool]) -> None:
        """Start the engine thread, which runs `step` while there is work (idempotent).

        `step` drains the inbox itself and must not raise.
        """
        if self._thread is None:
            self._stopping = False
            self._thread = threading.Thread(
                target=self._loop, args=(step, has_work), name="prefixgate-engine", daemon=True
            )
            self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Let the thread finish what is queued and running, then end it."""
        with self.lock:
            self._stopping = True
            self.lock.notify()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def post(self, action: Action) -> None:
        """Queue `action` for the engine thread's next step."""
        with self.lock:
            self._actions.append(action)
            self.lock.notify()

    def call(self, action: Callable[[], T]) -> T:
        """Run `action` on the engine thread (or right here if no thread runs) and wait."""
        if self._thread is None or threading.current_thread() is self._thread:
            self.drain()
            return action()
        future: Future[T] = Future()

        def run() -> None:
            try:
                future.set_result(action())
            except BaseException as error:  # handed to the waiting caller
                future.set_exception(error)

        self.post(run)
        return future.result()

    def drain(self) -> None:
        """Run every queued action, oldest first (on the engine thread).

        An action that raises passes its error on and leaves the actions after it queued for
        the next drain: none is lost (a lost one would leave its caller waiting for ever).
        """
        with self.lock:
            actions, self._actions = self._actions, []
        for index, action in enumerate(actions):
            try:
                action()
            except BaseException:
                with self.lock:
                    self._actions[:0] = actions[index + 1 :]
                raise

    def _loop(self, step: Callable[[], object], has_work: Callable[[], bool]) -> None:
        while True:
            with self.lock:
                while not self._actions and not has_work() and not self._stopping:
                    self.lock.wait(_IDLE_WAIT_S)
                if self._stopping and not self._actions and not has_work():
                    return
            step()
