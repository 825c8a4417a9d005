"""Fixtures shared by every test package."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

# isort: off
import engine  # noqa: F401 - before torch: its OpenMP defaults act when torch loads libgomp
import torch

# isort: on

if TYPE_CHECKING:
    from tests.support.gateway import Gateway

# Helpers there assert for many test modules: show their failures as pytest shows a test's.
pytest.register_assert_rewrite("tests.support")

# Without a GPU the Triton kernels run in Triton's interpreter, on CPU tensors. It is chosen
# when a kernel is defined, so before any test module imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _private_state_home(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Settings built without a state directory use a temporary one, never ~/.local/state."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path_factory.mktemp("xdg-state")))


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The embedded SmolLM2 model as a safetensors directory (converted once per machine)."""
    from engine.model.loader import embedded_model_dir

    return embedded_model_dir()


@pytest.fixture(scope="session")
def smollm2(smollm2_dir: Path) -> Any:
    from engine.model.loader import load_model

    return load_model(smollm2_dir)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2: Any) -> Any:
    return smollm2.tokenizer


@pytest.fixture(scope="session")
def migrated_template() -> Iterator[str]:
    """A PostgreSQL database at the newest schema, copied for each test that needs one."""
    from tenancy.migrate import upgrade
    from tests.support.postgres import create_database, database_url, drop_database

    name = create_database("prefixgate_template")
    upgrade(database_url(name))
    yield name
    drop_database(name)


@pytest.fixture
def postgres_url(migrated_template: str) -> Iterator[str]:
    """A fresh PostgreSQL database at the newest schema, dropped after the test."""
    from tests.support.postgres import create_database, database_url, drop_database

    name = create_database(template=migrated_template)
    yield database_url(name)
    drop_database(name)


@pytest.fixture
def empty_postgres_url() -> Iterator[str]:
    from tests.support.postgres import create_database, database_url, drop_database

    name = create_database()
    yield database_url(name)
    drop_database(name)


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    """Async tests (marked `anyio`) run on asyncio, as the server does."""
    return "asyncio"


@pytest.fixture(scope="session")
def redis_server() -> str:
    """The real Redis server's URL (PREFIXGATE_TEST_REDIS), once it answers."""
    from tests.support.redis import SERVER_URL, check_server

    check_server()
    return SERVER_URL


@pytest.fixture
def redis_prefix(redis_server: str) -> Iterator[str]:
    """A key prefix of this test's own on the Redis server, emptied after it."""
    from tests.support.redis import drop_prefix, new_prefix

    prefix = new_prefix()
    yield prefix
    drop_prefix(prefix)


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    from tenancy.migrate import upgrade

    url = f"sqlite:///{tmp_path / 'prefixgate.db'}"
    upgrade(url)
    return url


@pytest.fixture(params=["postgresql", "sqlite"])
def database(request: pytest.FixtureRequest) -> str:
    """Each test using this runs on PostgreSQL and on the embedded SQLite default."""
    fixture = "postgres_url" if request.param == "postgresql" else "sqlite_url"
    url: str = request.getfixturevalue(fixture)
    return url


@pytest.fixture
def store(database: str, tmp_path: Path) -> Iterator[Any]:
    from tenancy.store import Store

    opened = Store.open(database, tmp_path / "audit.spool", "key-secret", "signing-key", 5)
    yield opened
    opened.close()


@pytest.fixture(scope="session")
def tiny_chat_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """A small random Llama with SmolLM2's real tokenizer and chat template, for the gateways."""
    from bench.local_server import tiny_chat_model
    from tests.support.gateway import MODEL

    return tiny_chat_model(tmp_path_factory.mktemp("models") / MODEL, smollm2_dir)


@pytest.fixture(scope="session")
def gateway(
    migrated_template: str,
    tiny_chat_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
    redis_server: str,
) -> Iterator[Gateway]:
    """One real gateway for the whole run, shared by tests/gateway and tests/e2e (each start costs
    seconds), with the tenants of `SESSION_TENANTS`, keeping their limits in Redis as a
    deployment of several gateways does."""
    from tests.support.gateway import SESSION_TENANTS, start_gateway
    from tests.support.redis import drop_prefix, new_prefix

    state_dir = tmp_path_factory.mktemp("gateway-state")
    prefix = new_prefix()
    shared = {"redis_url": redis_server, "redis_key_prefix": prefix}
    try:
        with start_gateway(
            migrated_template, tiny_chat_dir, state_dir, SESSION_TENANTS, **shared
        ) as started:
            yield started
    finally:
        drop_prefix(prefix)
