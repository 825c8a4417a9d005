"""Login attempts per username and per client address, over a sliding minute (in memory).

This bounds how fast one process can be asked to guess passwords (each guess costs an argon2
hash); the account lockout in the database (`tenancy.admins.Lockout`) bounds it across
processes. Both keys are kept in a bounded map, so a flood of made-up usernames cannot grow it.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict, deque

WINDOW_S = 60.0
MAX_TRACKED = 10_000


class LoginThrottle:
    """Allows `per_minute` attempts per username and, separately, per address."""

    def __init__(self, per_minute: int) -> None:
        self.per_minute = per_minute
        self._attempts: OrderedDict[str, deque[float]] = OrderedDict()
        self._lock = threading.Lock()

    def admit(self, username: str, address: str | None) -> int | None:
        """Count one attempt; None if allowed, else the seconds until the next one is."""
        now = time.monotonic()
        keys = [f"user:{username}", f"ip:{address or 'unknown'}"]
        with self._lock:
            waits = [self._wait(key, now) for key in keys]
            if any(wait is not None for wait in waits):
                return max(wait for wait in waits if wait is not None)
            for key in keys:
                self._attempts.setdefault(key, deque()).append(now)
                self._attempts.move_to_end(key)
            while len(self._attempts) > MAX_TRACKED:
                self._attempts.popitem(last=False)
        return None

    def _wait(self, key: str, now: float) -> int | None:
        attempts = self._attempts.get(key)
        if attempts is None:
            return None
        while attempts and attempts[0] <= now - WINDOW_S:
            attempts.popleft()
        if len(attempts) < self.per_minute:
            return None
        return max(1, math.ceil(attempts[0] + WINDOW_S - now))
