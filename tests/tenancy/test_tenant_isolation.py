"""BOLA at the data layer: every repository function that takes a tenant returns nothing of
another tenant's."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from pathlib import Path
from typing import Any

import pytest

import tenancy
from tenancy import admins, api_keys, seal_keys, tenants
from tenancy.audit_chain import AuditRecord
from tenancy.audit_export import ExportFilter, export_events
from tenancy.audit_verification import verify_file
from tenancy.errors import NotFound

# Every public tenancy function that takes a tenant (id or object) is exercised below.
COVERED = {
    "tenancy.api_keys.create_key",
    "tenancy.api_keys.list_keys",
    "tenancy.api_keys.get_key",
    "tenancy.api_keys.revoke_key",
    "tenancy.api_keys.rotate_key",
    "tenancy.tenants.get_tenant_by_id",
    "tenancy.admins.create_admin",
    "tenancy.admins.list_admins",
    # Pinned in tests/tenancy/test_audit_search.py (another tenant's events never count).
    "tenancy.audit_search.request_totals",
    "tenancy.seal_keys.tenant_data_key",
    "tenancy.seal_keys.shred_tenant_key",
}


def tenant_scoped_functions() -> set[str]:
    found = set()
    for module_info in pkgutil.iter_modules(tenancy.__path__):
        module = importlib.import_module(f"tenancy.{module_info.name}")
        for name, function in inspect.getmembers(module, inspect.isfunction):
            if function.__module__ != module.__name__ or name.startswith("_"):
                continue
            if {"tenant", "tenant_id"} & set(inspect.signature(function).parameters):
                found.add(f"{module.__name__}.{name}")
    return found


def test_every_tenant_scoped_function_is_covered_here() -> None:
    assert tenant_scoped_functions() == COVERED


@pytest.fixture
def two_tenants(store: Any) -> tuple[Any, Any, Any, Any]:
    with store.transaction() as session:
        alpha = tenants.create_tenant(session, "alpha")
        beta = tenants.create_tenant(session, "beta")
        alpha_key = api_keys.create_key(session, alpha, "a", store.key_secret)
        beta_key = api_keys.create_key(session, beta, "b", store.key_secret)
    return alpha, beta, alpha_key.key, beta_key.key


def test_key_functions_never_reach_another_tenants_keys(
    store: Any, two_tenants: tuple[Any, Any, Any, Any]
) -> None:
    alpha, beta, alpha_key, beta_key = two_tenants
    with store.transaction() as session:
        assert [k.key_id for k in api_keys.list_keys(session, alpha.id)] == [alpha_key.key_id]
        assert [k.key_id for k in api_keys.list_keys(session, beta.id)] == [beta_key.key_id]
        assert api_keys.get_key(session, alpha.id, alpha_key.key_id).id == alpha_key.id
        for call in (
            lambda: api_keys.get_key(session, alpha.id, beta_key.key_id),
            lambda: api_keys.revoke_key(session, alpha.id, beta_key.key_id),
            lambda: api_keys.rotate_key(session, alpha, beta_key.key_id, store.key_secret),
        ):
            with pytest.raises(NotFound):
                call()
        created = api_keys.create_key(session, alpha, "new", store.key_secret)
        assert created.key.tenant_id == alpha.id
        assert beta_key.key_id not in {k.key_id for k in api_keys.list_keys(session, alpha.id)}
    with store.transaction() as session:
        assert api_keys.get_key(session, beta.id, beta_key.key_id).revoked_at is None


def test_data_key_functions_never_reach_another_tenants_key(
    store: Any, two_tenants: tuple[Any, Any, Any, Any]
) -> None:
    alpha, beta, _, _ = two_tenants
    master_key = bytes(32)
    with store.transaction() as session:
        alpha_key = seal_keys.tenant_data_key(session, master_key, alpha.id)
        beta_key = seal_keys.tenant_data_key(session, master_key, beta.id)
        assert alpha_key.secret != beta_key.secret and alpha_key.key_id != beta_key.key_id
        assert seal_keys.shred_tenant_key(session, alpha.id) is True
        assert seal_keys.tenant_data_key(session, master_key, beta.id) == beta_key
        assert seal_keys.tenant_data_key(session, master_key, alpha.id) != alpha_key  # a new one


def test_deleted_tenants_are_not_found_by_id(
    store: Any, two_tenants: tuple[Any, Any, Any, Any]
) -> None:
    alpha, beta, _, _ = two_tenants
    with store.transaction() as session:
        tenants.delete_tenant(session, "beta")
        assert tenants.get_tenant_by_id(session, alpha.id).slug == "alpha"
        with pytest.raises(NotFound):
            tenants.get_tenant_by_id(session, beta.id)


def test_tenant_filtered_audit_export_holds_only_that_tenant(
    store: Any, two_tenants: tuple[Any, Any, Any, Any], tmp_path: Path
) -> None:
    alpha, beta, _, _ = two_tenants
    for tenant in (alpha, beta, alpha):
        store.record(AuditRecord("api_key", "chat", "success", tenant_id=str(tenant.id)))
    out = tmp_path / "alpha.jsonl"
    with store.transaction() as session:
        count = export_events(session, ExportFilter(str(alpha.id)), out, "jsonl", store.signing_key)
    assert count == 2
    assert str(beta.id) not in out.read_text()
    assert verify_file(out, store.signing_key).ok


def test_operator_functions_bind_and_list_only_the_named_tenant(
    store: Any, two_tenants: tuple[Any, Any, Any, Any]
) -> None:
    alpha, beta, _, _ = two_tenants
    password = "a long enough password"
    with store.transaction() as session:
        admins.create_admin(session, "root", password)
        alpha_ops = admins.create_admin(session, "alpha-ops", password, "tenant-admin", alpha.id)
        beta_ops = admins.create_admin(session, "beta-ops", password, "tenant-admin", beta.id)
        assert alpha_ops.tenant_id == alpha.id
        assert [a.username for a in admins.list_admins(session, alpha.id)] == ["alpha-ops"]
        assert [a.username for a in admins.list_admins(session, beta.id)] == [beta_ops.username]
        tenants.delete_tenant(session, "beta")
        with pytest.raises(NotFound):  # no operator for a deleted tenant
            admins.create_admin(session, "late", password, "tenant-admin", beta.id)
