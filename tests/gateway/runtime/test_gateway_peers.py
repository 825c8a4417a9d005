"""Gateways report themselves to the database: each counts the others, and one that limits
alone warns, once, that with several gateways each tenant gets its limits once per gateway."""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import update

from gateway.runtime.peers import Peers, limits_store_id
from tenancy.models import GatewayInstance, utcnow
from tenancy.store import Store

ALONE = limits_store_id(None, "prefixgate")
SHARED = limits_store_id("redis://:pw@redis.internal:6379/0", "prefixgate")


@pytest.fixture
def store(database: str, tmp_path: Path) -> Store:
    return Store.open(database, tmp_path / "audit.spool", "key-secret", "signing-key", 5)


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_a_gateway_that_limits_alone_warns_once_when_it_sees_another(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "gateway.runtime.peers")
    alone = Peers(store, limits_store=ALONE)
    alone.report()
    assert alone.count == 1 and warnings(caplog) == []
    other = Peers(store, limits_store=ALONE)
    other.report()
    assert len(warnings(caplog)) == 1 and "PREFIXGATE_REDIS_URL is unset" in warnings(caplog)[0]
    alone.report()
    alone.report()
    assert alone.count == 2
    assert len(warnings(caplog)) == 2  # the second gateway's one line, and no repeats
    other.leave()
    alone.report()
    assert alone.count == 1


def test_a_sharing_gateway_names_the_one_that_does_not_share(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "gateway.runtime.peers")
    sharing, another = Peers(store, limits_store=SHARED), Peers(store, limits_store=SHARED)
    sharing.report()
    another.report()
    sharing.report()
    assert warnings(caplog) == []  # two gateways sharing their limits: nothing to say
    stray = Peers(store, limits_store=ALONE)
    stray.report()
    sharing.report()
    named = [w for w in warnings(caplog) if "without PREFIXGATE_REDIS_URL" in w]
    assert len(named) == 1 and f"pid {os.getpid()}" in named[0]
    elsewhere = Peers(store, limits_store_id("redis://redis.internal:6379/1", "prefixgate"))
    elsewhere.report()  # it warns of the three others in its turn
    caplog.clear()
    sharing.report()
    named = [w for w in warnings(caplog) if "another Redis or key prefix" in w]
    assert len(named) == 1 and warnings(caplog) == named  # it is named, and only it is new


def test_gateways_count_in_one_place_exactly_when_their_stores_are_one() -> None:
    assert limits_store_id(None, "prefixgate") == ""
    same = limits_store_id("redis://:one@redis.internal:6379/0", "prefixgate")
    assert same == limits_store_id("redis://:another-password@redis.internal/0", "prefixgate")
    assert same == limits_store_id("redis://redis.internal:6379", "prefixgate")  # db 0 default
    for other in (
        limits_store_id("redis://redis.internal:6379/1", "prefixgate"),
        limits_store_id("redis://redis.internal:6380/0", "prefixgate"),
        limits_store_id("redis://other.internal:6379/0", "prefixgate"),
        limits_store_id("redis://redis.internal:6379/0", "staging"),
    ):
        assert other != same and other.startswith("redis:")
    assert "one" not in same and "redis.internal" not in same  # a digest, not the URL


def test_gateways_not_seen_lately_are_not_counted_and_old_ones_are_forgotten(
    store: Store,
) -> None:
    gone, here = Peers(store, limits_store=SHARED), Peers(store, limits_store=SHARED)
    gone.report()
    with store.transaction() as session:
        session.execute(
            update(GatewayInstance)
            .where(GatewayInstance.id == gone.instance_id)
            .values(seen_at=utcnow() - timedelta(minutes=5))
        )
    here.report()
    assert here.count == 1
    with store.transaction() as session:
        session.execute(
            update(GatewayInstance)
            .where(GatewayInstance.id == gone.instance_id)
            .values(seen_at=utcnow() - timedelta(days=2))
        )
    here.report()
    with store.transaction() as session:
        assert session.get(GatewayInstance, gone.instance_id) is None
