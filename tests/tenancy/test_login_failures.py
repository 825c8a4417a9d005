"""Failed operator logins per (name, source) pair (PostgreSQL and SQLite): the wait grows with
each failure past the free ones and is capped, other sources never wait, a success clears the
pair, unknown names count exactly like known ones, and stale or surplus pairs are forgotten."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import func, select

from tenancy import login_failures
from tenancy.login_failures import LoginDelays, pair_key
from tenancy.models import AdminLoginFailure, utcnow

DELAYS = LoginDelays(free_failures=3, max_delay=timedelta(seconds=60))
SECRET = "key-secret"


def test_the_wait_doubles_per_failure_past_the_free_ones_and_is_capped() -> None:
    waits = [DELAYS.after(failures).total_seconds() for failures in range(12)]
    assert waits == [0, 0, 0, 1, 2, 4, 8, 16, 32, 60, 60, 60]
    assert DELAYS.after(10_000) == timedelta(seconds=60)  # no overflow, however many


def test_pairs_differ_by_source_but_not_by_case_or_unicode_form() -> None:
    assert pair_key(SECRET, "Root", "203.0.113.1") == pair_key(SECRET, "root", "203.0.113.1")
    assert pair_key(SECRET, "r\u00f6ot", "a") == pair_key(SECRET, "ro\u0308ot", "a")
    assert pair_key(SECRET, "root", "203.0.113.1") != pair_key(SECRET, "root", "203.0.113.2")
    assert pair_key(SECRET, "root", "x") != pair_key("another secret", "root", "x")
    assert "root" not in pair_key(SECRET, "root", "203.0.113.1")


def test_a_pair_waits_after_its_free_failures_and_other_sources_never_do(store: Any) -> None:
    attacker = pair_key(SECRET, "root", "198.51.100.66")
    colleague = pair_key(SECRET, "root", "192.0.2.10")
    start = utcnow()
    with store.transaction() as session:
        for failure in range(1, 7):
            moment = start + timedelta(minutes=failure)  # each after the previous wait
            assert login_failures.wait_before_attempt(session, attacker, DELAYS, moment) is None
            assert login_failures.record_failure(session, attacker, moment) == failure
        last = start + timedelta(minutes=6)
        # 6 failures, 3 free: the next attempt waits 2**3 = 8 s after the last one.
        wait = login_failures.wait_before_attempt(session, attacker, DELAYS, last)
        assert wait == timedelta(seconds=8)
        later = last + timedelta(seconds=5)
        assert login_failures.wait_before_attempt(session, attacker, DELAYS, later) == (
            timedelta(seconds=3)
        )
        assert (
            login_failures.wait_before_attempt(
                session, attacker, DELAYS, last + timedelta(seconds=8)
            )
            is None
        )
        assert login_failures.wait_before_attempt(session, colleague, DELAYS, last) is None
        login_failures.clear(session, attacker)
        assert login_failures.wait_before_attempt(session, attacker, DELAYS, last) is None


def test_a_pair_is_forgotten_a_day_after_its_last_failure(store: Any) -> None:
    pair = pair_key(SECRET, "ops", "198.51.100.7")
    then = utcnow() - timedelta(days=2)
    with store.transaction() as session:
        for _ in range(10):
            login_failures.record_failure(session, pair, then)
        assert login_failures.wait_before_attempt(session, pair, DELAYS) is None
        # A new failure starts the count again, and the stale rows go.
        assert login_failures.record_failure(session, pair) == 1


def test_made_up_names_cannot_grow_the_table_past_its_bound(
    store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(login_failures, "MAX_ROWS", 5)
    kept = pair_key(SECRET, "root", "198.51.100.1")
    now = utcnow()
    with store.transaction() as session:
        for _ in range(4):
            login_failures.record_failure(session, kept, now - timedelta(minutes=5))
        for index in range(20):
            made_up = pair_key(SECRET, f"nobody-{index}", "198.51.100.1")
            login_failures.record_failure(session, made_up, now + timedelta(seconds=index))
        rows = session.scalar(select(func.count()).select_from(AdminLoginFailure))
        assert rows == 5
        # The pair with the most failures stays: a flood does not reset a guesser's wait.
        assert session.get(AdminLoginFailure, kept) is not None


def test_failures_sent_at_the_same_moment_each_count(store: Any) -> None:
    pair = pair_key(SECRET, "ops", "198.51.100.9")
    barrier = threading.Barrier(6)

    def fail(_: int) -> int:
        barrier.wait()
        with store.transaction() as session:
            return login_failures.record_failure(session, pair)

    with ThreadPoolExecutor(6) as pool:
        counts = sorted(pool.map(fail, range(6)))
    assert counts == [1, 2, 3, 4, 5, 6]


def test_attempts_of_one_pair_sent_at_once_are_counted_one_after_another(store: Any) -> None:
    """Guesses sent together cannot all pass the same wait: the second attempt of a pair
    waits until the first one's failure is counted, then sees the wait it earned."""
    delays = LoginDelays(free_failures=1, max_delay=timedelta(seconds=60))
    pair = pair_key(SECRET, "ops", "198.51.100.10")
    first_in = threading.Event()

    def first() -> None:
        with store.transaction() as session:
            assert login_failures.wait_before_attempt(session, pair, delays) is None
            first_in.set()
            time.sleep(0.5)  # its password check, while the second attempt arrives
            login_failures.record_failure(session, pair)

    def second() -> timedelta | None:
        assert first_in.wait(10)
        with store.transaction() as session:
            return login_failures.wait_before_attempt(session, pair, delays)

    with ThreadPoolExecutor(2) as pool:
        checked, waited = pool.submit(first), pool.submit(second)
        checked.result()
        assert waited.result() is not None


def test_attempts_sent_at_once_within_the_free_failures_all_go_through(store: Any) -> None:
    """Checked one after another, each still within the free failures: none is told to wait
    (a failure counted while one waited for the lock is not in its future)."""
    pair = pair_key(SECRET, "ops", "198.51.100.11")
    barrier = threading.Barrier(DELAYS.free_failures)

    def attempt(_: int) -> timedelta | None:
        barrier.wait()
        with store.transaction() as session:
            wait = login_failures.wait_before_attempt(session, pair, DELAYS)
            time.sleep(0.05)  # its password check
            login_failures.record_failure(session, pair)
            return wait

    with ThreadPoolExecutor(DELAYS.free_failures) as pool:
        waits = list(pool.map(attempt, range(DELAYS.free_failures)))
    assert waits == [None] * DELAYS.free_failures
