"""The state directory is private (0700) whichever process creates it first."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from tenancy.private_paths import create_private_file, private_directory
from tests.support.cli import Cli


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def permissive_umask() -> Iterator[None]:
    """A umask under which a plain mkdir makes a directory everyone can list."""
    previous = os.umask(0o002)
    yield
    os.umask(previous)


@pytest.mark.usefixtures("permissive_umask")
def test_a_cli_command_on_postgresql_creates_the_state_directory_private(
    postgres_url: str, tmp_path: Path
) -> None:
    # The database lives elsewhere, so the audit spool and checkpoints create the directory.
    state = tmp_path / "fresh" / "state"
    Cli(postgres_url, state).ok("tenants", "create", "acme")
    assert mode_of(state) == 0o700
    assert mode_of(state.parent) != 0o700  # parents are the system's, made as usual
    for child in state.iterdir():
        if child.is_file():
            assert mode_of(child) == 0o600, child.name


@pytest.mark.usefixtures("permissive_umask")
def test_private_paths_ignore_a_umask_that_would_take_the_owners_bits(tmp_path: Path) -> None:
    os.umask(0o277)
    private_directory(tmp_path / "state")
    create_private_file(tmp_path / "state" / "db")
    os.umask(0o002)
    assert mode_of(tmp_path / "state") == 0o700
    assert mode_of(tmp_path / "state" / "db") == 0o600


def test_an_existing_directory_keeps_the_mode_its_operator_gave_it(tmp_path: Path) -> None:
    shared = tmp_path / "volume"
    shared.mkdir(mode=0o750)
    shared.chmod(0o750)
    private_directory(shared)
    assert mode_of(shared) == 0o750


@pytest.mark.usefixtures("permissive_umask")
def test_a_disk_tier_that_creates_the_state_directory_creates_it_private(
    tmp_path: Path,
) -> None:
    # A worker has no database and no generated secrets: with PREFIXGATE_KV_TIER=disk its
    # tier file (under <state_dir>/kv-tier by default) may be the first thing made there.
    from engine.cache.tier.backends import make_tier
    from gateway.runtime.engine_setup import tier_config
    from gateway.settings import Settings
    from tests.engine.cache.tier.conftest import ROOT, SPEC

    settings = Settings(state_dir=tmp_path / "fresh" / "state", kv_tier="disk")
    config = tier_config(settings)  # as the engine's set-up asks for the tier
    assert config is not None and config.directory == settings.tier_dir
    tier = make_tier(
        "disk", spec=SPEC, root=ROOT, capacity_bytes=1 << 20, directory=config.directory
    )
    tier.close()
    assert mode_of(settings.tier_dir) == 0o700
    assert mode_of(settings.state_dir) == 0o700
