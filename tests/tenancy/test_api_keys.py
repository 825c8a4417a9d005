"""API keys: create, verify, revoke, expire, rotate with grace; never stored in plaintext."""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import MetaData, select

from tenancy import api_keys, tenants
from tenancy.api_keys import AuthFailure, VerifiedKey
from tenancy.key_format import MalformedKey, ParsedKey, format_key, new_key, parse_key
from tenancy.models import utcnow

SECRET = "key-secret"


def make_tenant(store: Any, slug: str = "acme") -> Any:
    with store.transaction() as session:
        return tenants.create_tenant(session, slug)


def authenticate(store: Any, presented: str, **kwargs: Any) -> VerifiedKey | AuthFailure:
    with store.transaction() as session:
        return api_keys.authenticate(session, presented, store.key_secret, **kwargs)


def test_a_new_key_parses_back_to_its_parts_and_a_typo_fails_its_checksum() -> None:
    full, parts = new_key()
    assert full.startswith(f"pgk_{parts.key_id}_{parts.secret}")
    assert parse_key(full) == parts
    typo = full[:-8] + ("A" if full[-8] != "A" else "B") + full[-7:]
    with pytest.raises(MalformedKey, match="checksum"):
        parse_key(typo)
    with pytest.raises(MalformedKey):
        parse_key("sk-not-ours")


def test_a_key_of_the_right_shape_with_non_ascii_characters_is_malformed_not_a_crash() -> None:
    full, parts = new_key()
    lookalike = full.replace(parts.key_id[0], "é", 1)  # a header's latin-1 byte, decoded
    with pytest.raises(MalformedKey):
        parse_key(lookalike)


def test_a_created_key_authenticates_its_tenant_and_role_and_near_misses_fail_typed(
    store: Any,
) -> None:
    tenant = make_tenant(store)
    with store.transaction() as session:
        created = api_keys.create_key(session, tenant, "ci", SECRET, role="tenant-admin")
    principal = authenticate(store, created.secret)
    assert isinstance(principal, VerifiedKey)
    assert (principal.tenant_slug, principal.role) == ("acme", "tenant-admin")
    typo = "y" if created.secret.endswith("x") else "x"  # a different last character, always
    assert authenticate(store, created.secret[:-1] + typo) is AuthFailure.MALFORMED
    other, other_parts = new_key()
    # The right key id with another secret and a valid checksum: only the HMAC can tell.
    forged = format_key(ParsedKey(parse_key(created.secret).key_id, other_parts.secret))
    assert authenticate(store, forged) is AuthFailure.WRONG_SECRET
    assert authenticate(store, other) is AuthFailure.UNKNOWN


def test_revoked_and_expired_keys_stop_working(store: Any) -> None:
    tenant = make_tenant(store)
    with store.transaction() as session:
        revoked = api_keys.create_key(session, tenant, "old", SECRET)
        expiring = api_keys.create_key(
            session, tenant, "temp", SECRET, expires_at=utcnow() + timedelta(hours=1)
        )
    with store.transaction() as session:
        api_keys.revoke_key(session, tenant.id, revoked.key.key_id)
    assert authenticate(store, revoked.secret) is AuthFailure.REVOKED
    assert isinstance(authenticate(store, expiring.secret), VerifiedKey)
    later = utcnow() + timedelta(hours=2)
    assert authenticate(store, expiring.secret, now=later) is AuthFailure.EXPIRED


def test_rotation_keeps_the_old_key_for_the_grace_period_only(store: Any) -> None:
    tenant = make_tenant(store)
    with store.transaction() as session:
        old = api_keys.create_key(session, tenant, "svc", SECRET)
    with store.transaction() as session:
        new = api_keys.rotate_key(session, tenant, old.key.key_id, SECRET, timedelta(hours=24))
    assert isinstance(authenticate(store, old.secret), VerifiedKey)
    assert isinstance(authenticate(store, new.secret), VerifiedKey)
    tomorrow = utcnow() + timedelta(hours=25)
    assert authenticate(store, old.secret, now=tomorrow) is AuthFailure.EXPIRED
    assert isinstance(authenticate(store, new.secret, now=tomorrow), VerifiedKey)
    assert new.key.rotated_from_id == old.key.id


def test_suspended_and_deleted_tenants_cannot_authenticate(store: Any) -> None:
    tenant = make_tenant(store)
    with store.transaction() as session:
        created = api_keys.create_key(session, tenant, "k", SECRET)
        tenants.set_status(session, "acme", "suspended")
    assert authenticate(store, created.secret) is AuthFailure.TENANT_SUSPENDED
    with store.transaction() as session:
        tenants.set_status(session, "acme", "active")
        tenants.delete_tenant(session, "acme")
    assert authenticate(store, created.secret) is AuthFailure.REVOKED


def test_no_table_holds_a_plaintext_secret(store: Any, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    tenant = make_tenant(store)
    secrets = []
    with store.transaction() as session:
        for index in range(3):
            created = api_keys.create_key(session, tenant, f"k{index}", SECRET)
            secrets.append(created.secret)
    with store.transaction() as session:
        rotated = api_keys.rotate_key(session, tenant, parse_key(secrets[0]).key_id, SECRET)
        secrets.append(rotated.secret)
    for secret in secrets:
        authenticate(store, secret)
    metadata = MetaData()
    metadata.reflect(store.engine)
    dump = []
    with store.engine.connect() as connection:
        for table in metadata.sorted_tables:
            dump += [repr(row) for row in connection.execute(select(table))]
    text = "\n".join(dump) + caplog.text
    assert "api_keys" in {t.name for t in metadata.sorted_tables}
    for secret in secrets:
        assert parse_key(secret).secret not in text
        assert secret not in text
