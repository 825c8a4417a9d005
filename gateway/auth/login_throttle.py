"""How fast administrators may act, in memory: login attempts per client address, password
checks at once, and changes per caller.

The per-address limit bounds how fast one source can guess across many names (password
spraying; each guess costs an argon2 hash). It never counts per name: a name's failures slow
down only the (name, source) pairs that made them, in the database that every gateway shares
(tenancy/login_failures.py), so nobody can keep an operator from logging in from elsewhere.
An IPv6 source counts by its /64 network, which one client usually holds whole. The change
limit keeps one tenant-admin from flooding the tenancy database (every change also makes every
gateway re-check its cached keys). Keys are kept in bounded maps, so a flood of made-up
addresses cannot grow them.
"""

from __future__ import annotations

import ipaddress
import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterator
from contextlib import contextmanager

WINDOW_S = 60.0
MAX_TRACKED = 10_000


class SlidingWindow:
    """At most `per_minute` events per key over any 60 seconds."""

    def __init__(self, per_minute: int) -> None:
        self.per_minute = per_minute
        self._events: OrderedDict[str, deque[float]] = OrderedDict()
        self._lock = threading.Lock()

    def admit(self, *keys: str) -> int | None:
        """Count one event under every key if each has room: None, else the seconds until
        the fullest has room again (nothing is counted then)."""
        now = time.monotonic()
        with self._lock:
            waits = [wait for key in keys if (wait := self._wait(key, now)) is not None]
            if waits:
                return max(waits)
            for key in keys:
                self._events.setdefault(key, deque()).append(now)
                self._events.move_to_end(key)
            while len(self._events) > MAX_TRACKED:
                self._events.popitem(last=False)
        return None

    def give_back(self, key: str) -> None:
        """Uncount the latest event under `key` (one that turned out not to count)."""
        with self._lock:
            events = self._events.get(key)
            if events:
                events.pop()

    def _wait(self, key: str, now: float) -> int | None:
        events = self._events.get(key)
        if events is None:
            return None
        while events and events[0] <= now - WINDOW_S:
            events.popleft()
        if len(events) < self.per_minute:
            return None
        return max(1, math.ceil(events[0] + WINDOW_S - now))


class PasswordChecksBusy(Exception):
    """Every password-hashing slot stayed taken for the whole wait."""


def login_source(address: str | None) -> str:
    """The source a login attempt is counted under: its address, or for IPv6 its /64."""
    if address is None:
        return "unknown"
    try:
        parsed = ipaddress.ip_address(address)
    except ValueError:
        return address[:64]
    if isinstance(parsed, ipaddress.IPv6Address):
        if parsed.ipv4_mapped is not None:
            return str(parsed.ipv4_mapped)
        return str(ipaddress.ip_network(f"{parsed}/64", strict=False))
    return str(parsed)


class LoginThrottle:
    """Allows `per_minute` failed (or pending) login attempts per source, and at most
    `concurrent_hashes` password checks at once in the process (each argon2 check costs tens
    of milliseconds of CPU and 64 MiB of memory: a login flood from many addresses must not
    take the CPU and memory that inference needs)."""

    def __init__(self, per_minute: int, concurrent_hashes: int = 2) -> None:
        self._attempts = SlidingWindow(per_minute)
        self._hashing = threading.BoundedSemaphore(concurrent_hashes)

    def admit(self, source: str) -> int | None:
        """Count one attempt from `source` (`login_source`); None if allowed, else the seconds
        until the next one is."""
        return self._attempts.admit(f"source:{source}")

    def succeeded(self, source: str) -> None:
        """An attempt from `source` had the right credentials: it does not count, so that
        guesses from a shared address (a NAT, a proxy that is not trusted) cannot make a
        colleague's correct login wait; only failures and checks under way use up the limit."""
        self._attempts.give_back(f"source:{source}")

    @contextmanager
    def password_check(self, wait_s: float = 5.0) -> Iterator[None]:
        """Hold one password-hashing slot; PasswordChecksBusy if none frees within `wait_s`."""
        if not self._hashing.acquire(timeout=wait_s):
            raise PasswordChecksBusy
        try:
            yield
        finally:
            self._hashing.release()
