"""engine/openmp.py: the OpenMP default the engine sets, and what another program's process
inherits from it (a fresh interpreter each: the default acts once, at `import engine`)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = (
    "import os, engine\n"
    "from engine.openmp import foreign_environment\n"
    "print(os.environ['OMP_WAIT_POLICY'], foreign_environment().get('OMP_WAIT_POLICY'))\n"
)


def probe(policy: str | None) -> list[str]:
    env = {name: value for name, value in os.environ.items() if name != "OMP_WAIT_POLICY"}
    if policy is not None:
        env["OMP_WAIT_POLICY"] = policy
    done = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, check=True, capture_output=True, text=True
    )
    return done.stdout.split()


def test_idle_threads_sleep_by_default_and_another_program_does_not_inherit_it() -> None:
    assert probe(None) == ["PASSIVE", "None"]


@pytest.mark.parametrize("policy", ["ACTIVE", "PASSIVE"])
def test_a_policy_the_environment_chose_is_kept_and_passed_on(policy: str) -> None:
    assert probe(policy) == [policy, policy]
