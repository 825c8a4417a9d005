"""Data keys: one per tenant and one per public prefix, which seal that owner's KV blocks in the
second tier, stored only wrapped by the deployment's master key; deleting one is
crypto-shredding.

A data key is 32 random bytes (AES-256), made the first time its owner needs one and named by a
public `key_id` (`t-<tenant hex[:12]>-<8 random hex>`, `p-...` for a prefix) that sealed values
carry. Its row in `seal_keys` holds it wrapped: AES-256-GCM under the master key, with a fresh
96-bit nonce, and the row's subject (`tenant:<uuid>` or `prefix:<uuid>`) and key id as
associated data, so wrapped bytes copied onto another subject, or under another key id, fail
their tag. A row that does not unwrap raises `DataKeyUnreadable`; it never yields a key.

Two gateways asking for a new owner's key at once get the same one: the maker locks the owner's
row (FOR UPDATE, on PostgreSQL) and reads again before it inserts, and the unique subject
settles any race that still gets through: the loser's insert rolls back to its savepoint and it
reads the winner's key. The same lock orders key making against deletion: `delete_tenant`
(tenancy/tenants.py) and prefix deletion update or delete the owner's row, then shred its key in
the same transaction, so a key is never left behind for an owner deleted at the same moment,
and `tenant_data_key` refuses a deleted tenant (`DataKeyShredded`): its key is never made again.
A shredded key's tier entries are unreadable at once, wherever they are; callers that keep a
`DataKey` in memory must forget it when they learn of the deletion.

Nothing here imports the engine: it receives the key id and the 32 bytes.
"""

from __future__ import annotations

import secrets
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from sqlalchemy import CursorResult, delete, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from tenancy.errors import NotFound, TenancyError
from tenancy.models import PublicPrefix, Tenant, WrappedDataKey

KEY_BYTES = 32  # AES-256, for data keys and the master key alike
NONCE_BYTES = 12
TAG_BYTES = 16
WRAPPED_BYTES = NONCE_BYTES + KEY_BYTES + TAG_BYTES
# Bound into every wrapped key, so bytes wrapped for another purpose never pass for one.
_CONTEXT = b"prefixgate data key v1"


class DataKeyUnreadable(TenancyError):
    """A stored data key does not unwrap under this master key: another deployment's master
    key, or wrapped bytes moved onto another subject or key id."""


class DataKeyShredded(NotFound):
    """The owner was deleted: its data key is gone, and no new one is ever made for it."""


@dataclass(frozen=True, slots=True)
class DataKey:
    """An owner's data key: `key_id` names it in sealed values (public), `secret` seals them."""

    key_id: str
    secret: bytes = field(repr=False)  # 32 bytes; never in a repr, a log line or a traceback

    def __post_init__(self) -> None:
        if len(self.secret) != KEY_BYTES:
            raise ValueError(f"a data key is {KEY_BYTES} bytes")


def _tenant_subject(tenant_id: uuid.UUID) -> str:
    return f"tenant:{tenant_id}"


def _prefix_subject(prefix_id: uuid.UUID) -> str:
    return f"prefix:{prefix_id}"


def tenant_data_key(session: Session, master_key: bytes, tenant_id: uuid.UUID) -> DataKey:
    """The tenant's data key, made on first use; `DataKeyShredded` for a deleted tenant,
    `NotFound` for no tenant, `DataKeyUnreadable` for a row this master key cannot unwrap."""

    def check(lock: bool) -> None:
        query = select(Tenant.status).where(Tenant.id == tenant_id)
        status = session.scalar(query.with_for_update() if lock else query)
        if status is None:
            raise NotFound(f"no tenant with id {tenant_id}")
        if status == "deleted":
            raise DataKeyShredded(
                f"tenant {tenant_id} was deleted: its data key is shredded for good"
            )

    return _data_key(
        session, master_key, _tenant_subject(tenant_id), f"t-{tenant_id.hex[:12]}", check
    )


def prefix_data_key(session: Session, master_key: bytes, prefix_id: uuid.UUID) -> DataKey:
    """The public prefix's data key, made on first use; `NotFound` once the prefix is deleted
    (its key went with it), `DataKeyUnreadable` for a row this master key cannot unwrap."""

    def check(lock: bool) -> None:
        query = select(PublicPrefix.id).where(PublicPrefix.id == prefix_id)
        if session.scalar(query.with_for_update() if lock else query) is None:
            raise NotFound(f"no prefix with id {prefix_id}")

    return _data_key(
        session, master_key, _prefix_subject(prefix_id), f"p-{prefix_id.hex[:12]}", check
    )


def shred_tenant_key(session: Session, tenant_id: uuid.UUID) -> bool:
    """Delete the tenant's data key; whether there was one."""
    return _shred(session, _tenant_subject(tenant_id))


def shred_prefix_key(session: Session, prefix_id: uuid.UUID) -> bool:
    """Delete the public prefix's data key; whether there was one."""
    return _shred(session, _prefix_subject(prefix_id))


def _data_key(
    session: Session,
    master_key: bytes,
    subject: str,
    key_id_stem: str,
    check_owner: Callable[[bool], None],
) -> DataKey:
    """The subject's key: read it, else lock the owner, read again and make it."""
    if len(master_key) != KEY_BYTES:
        raise ValueError(f"the master key is {KEY_BYTES} bytes")
    check_owner(False)
    row = _stored(session, subject)
    if row is None:
        check_owner(True)  # waits for a maker or a deletion of this owner to commit
        row = _stored(session, subject) or _make(session, master_key, subject, key_id_stem)
    return _unwrap(master_key, row)


def _stored(session: Session, subject: str) -> WrappedDataKey | None:
    return session.scalar(select(WrappedDataKey).where(WrappedDataKey.subject == subject))


def _make(session: Session, master_key: bytes, subject: str, key_id_stem: str) -> WrappedDataKey:
    """A new random key for `subject`, or the one another process inserted first."""
    key_id = f"{key_id_stem}-{secrets.token_hex(4)}"
    wrapped = _wrap(master_key, subject, key_id, secrets.token_bytes(KEY_BYTES))
    row = WrappedDataKey(subject=subject, key_id=key_id, wrapped=wrapped)
    try:
        with session.begin_nested():  # a lost race rolls back this insert only
            session.add(row)
    except IntegrityError:
        winner = _stored(session, subject)
        if winner is None:  # not a race on the subject (a key id taken twice): let it show
            raise
        return winner
    return row


def _shred(session: Session, subject: str) -> bool:
    result = session.execute(delete(WrappedDataKey).where(WrappedDataKey.subject == subject))
    return cast(CursorResult[Any], result).rowcount > 0


def _associated_data(subject: str, key_id: str) -> bytes:
    # Subjects and key ids are made here, never hold a NUL: the fields cannot run together.
    return b"\0".join((_CONTEXT, subject.encode(), key_id.encode()))


def _wrap(master_key: bytes, subject: str, key_id: str, secret: bytes) -> bytes:
    nonce = secrets.token_bytes(NONCE_BYTES)
    sealed = AESGCM(master_key).encrypt(nonce, secret, _associated_data(subject, key_id))
    return nonce + sealed


def _unwrap(master_key: bytes, row: WrappedDataKey) -> DataKey:
    wrapped = bytes(row.wrapped)
    unreadable = DataKeyUnreadable(
        f"the data key of {row.subject} does not unwrap under this master key (another "
        "deployment's master key, or a row not written for this subject)"
    )
    if len(wrapped) != WRAPPED_BYTES:
        raise unreadable
    nonce, sealed = wrapped[:NONCE_BYTES], wrapped[NONCE_BYTES:]
    try:
        secret = AESGCM(master_key).decrypt(
            nonce, sealed, _associated_data(row.subject, row.key_id)
        )
    except InvalidTag:
        raise unreadable from None
    return DataKey(row.key_id, secret)
