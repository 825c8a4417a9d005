"""Storage of admin-registered public prefixes (the policy module decides what they mean).

A prefix is named by (model, namespace, name), as the CLI does, or by its id, as the admin API
does. Deleting one shreds its data key (tenancy/seal_keys.py) in the same transaction: its
blocks in a second tier are unreadable from the commit on.
"""

from __future__ import annotations

import re
import uuid

from sqlalchemy import select
from sqlalchemy.orm import Session

from tenancy.errors import Conflict, InvalidInput, NotFound
from tenancy.models import PublicPrefix
from tenancy.seal_keys import shred_prefix_key

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")


def add_prefix(
    session: Session, model: str, namespace: str, name: str, text: str, created_by: str
) -> PublicPrefix:
    for field, value in (("namespace", namespace), ("name", name)):
        if not _NAME.match(value):
            raise InvalidInput(f"{field}: 1-100 letters, digits or _ . - (got {value!r})", field)
    if not model:
        raise InvalidInput("model must not be empty", "model")
    if not text.strip():
        raise InvalidInput("the prefix text is empty", "text")
    existing = session.scalar(
        select(PublicPrefix.id).where(
            PublicPrefix.model == model,
            PublicPrefix.namespace == namespace,
            PublicPrefix.name == name,
        )
    )
    if existing is not None:
        raise Conflict(f"prefix {namespace}/{name} already exists for model {model!r}")
    prefix = PublicPrefix(
        model=model, namespace=namespace, name=name, text=text, created_by=created_by
    )
    session.add(prefix)
    session.flush()
    return prefix


def list_prefixes(
    session: Session, model: str | None = None, enabled_only: bool = False
) -> list[PublicPrefix]:
    query = select(PublicPrefix).order_by(
        PublicPrefix.model, PublicPrefix.namespace, PublicPrefix.name
    )
    if model is not None:
        query = query.where(PublicPrefix.model == model)
    if enabled_only:
        query = query.where(PublicPrefix.enabled.is_(True))
    return list(session.scalars(query))


def get_prefix(session: Session, model: str, namespace: str, name: str) -> PublicPrefix:
    prefix = session.scalar(
        select(PublicPrefix).where(
            PublicPrefix.model == model,
            PublicPrefix.namespace == namespace,
            PublicPrefix.name == name,
        )
    )
    if prefix is None:
        raise NotFound(f"no prefix {namespace}/{name} for model {model!r}")
    return prefix


def get_prefix_by_id(session: Session, prefix_id: uuid.UUID) -> PublicPrefix:
    """A prefix by its id, or NotFound."""
    prefix = session.get(PublicPrefix, prefix_id)
    if prefix is None:
        raise NotFound(f"no prefix with id {prefix_id}")
    return prefix


def set_enabled(
    session: Session, model: str, namespace: str, name: str, enabled: bool
) -> PublicPrefix:
    return _set_enabled(session, get_prefix(session, model, namespace, name), enabled)


def set_enabled_by_id(session: Session, prefix_id: uuid.UUID, enabled: bool) -> PublicPrefix:
    """Enable or disable the prefix with this id."""
    return _set_enabled(session, get_prefix_by_id(session, prefix_id), enabled)


def delete_prefix(session: Session, model: str, namespace: str, name: str) -> bool:
    """Delete the prefix named so and shred its data key; whether it had one."""
    return _delete(session, get_prefix(session, model, namespace, name))


def delete_prefix_by_id(session: Session, prefix_id: uuid.UUID) -> bool:
    """Delete the prefix with this id and shred its data key; whether it had one."""
    return _delete(session, get_prefix_by_id(session, prefix_id))


def _set_enabled(session: Session, prefix: PublicPrefix, enabled: bool) -> PublicPrefix:
    prefix.enabled = enabled
    session.flush()
    return prefix


def _delete(session: Session, prefix: PublicPrefix) -> bool:
    prefix_id = prefix.id
    session.delete(prefix)
    # Deleted first: the row's lock makes a data key being made at this moment commit before
    # the shredding reads (or find no prefix and make none).
    session.flush()
    return shred_prefix_key(session, prefix_id)
