"""bench.local_workers' certificates: one CA for a whole process, however its workers start."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

# Eight threads ask for the session's certificates at the same instant, as workers started
# side by side do (tests/scale_out/test_replicas.py's `enter_together`); each prints its CA.
SIDE_BY_SIDE = """
import threading
from concurrent.futures import ThreadPoolExecutor
from bench.local_workers import session_certificates

start = threading.Barrier(8)

def ask(_: int) -> bytes:
    start.wait()
    return session_certificates().ca.read_bytes()

with ThreadPoolExecutor(8) as pool:
    print(len(set(pool.map(ask, range(8)))))
"""


def test_workers_started_side_by_side_share_one_ca() -> None:
    # A fresh interpreter: this one's session certificates may already exist.
    done = subprocess.run(
        [sys.executable, "-c", SIDE_BY_SIDE],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "1"  # one CA: a gateway trusts every such worker
