"""A real `prefixgate serve` in a subprocess, for benchmarks that go through the HTTP API.

Its own process (its own GIL), a temporary state directory with SQLite, and a tenant and key
made with the CLI, as an operator would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from gateway.local_server import free_port


@contextmanager
def served_gateway(
    model_dir: Path,
    kv_cache_bytes: int,
    dtype: str,
    quota_blocks: int,
    max_num_seqs: int,
    tenant: str,
) -> Iterator[tuple[str, str]]:
    """`prefixgate serve` on a free port with fresh SQLite state and one tenant whose limits
    no benchmark reaches; yields the server's URL and the tenant's API key."""
    cli = str(Path(sys.executable).with_name("prefixgate"))
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as scratch:
        state, port = Path(scratch), free_port()
        env = {
            **os.environ,
            "PREFIXGATE_STATE_DIR": scratch,
            "PREFIXGATE_DATABASE_URL": f"sqlite:///{state / 'bench.db'}",
            "PREFIXGATE_MODEL_DIR": str(model_dir),
            "PREFIXGATE_KV_CACHE_BYTES": str(kv_cache_bytes),
            "PREFIXGATE_DTYPE": dtype,
            "PREFIXGATE_MAX_NUM_SEQS": str(max_num_seqs),
        }

        def cli_json(arguments: str) -> Any:
            done = subprocess.run(
                [cli, *arguments.split(), "--json"],
                env=env,
                cwd=scratch,
                check=True,
                capture_output=True,
                text=True,
            )
            return json.loads(done.stdout)

        subprocess.run(
            [cli, "db", "upgrade"], env=env, cwd=scratch, check=True, capture_output=True
        )
        cli_json(
            f"tenants create {tenant} --quota {quota_blocks} --rpm 100000 --tpm {10**9} "
            "--concurrent 1000"
        )
        key = cli_json(f"keys create --tenant {tenant}")["key"]
        log = state / "serve.log"
        with open(log, "w") as log_file:
            server = subprocess.Popen(
                [cli, "serve", "--port", str(port)],
                env=env,
                cwd=scratch,
                stdout=log_file,
                stderr=subprocess.STDOUT,
            )
        try:
            url = f"http://127.0.0.1:{port}"
            wait_ready(url, server, log)
            yield url, key
        finally:
            server.terminate()
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


def wait_ready(url: str, server: subprocess.Popen[bytes], log: Path) -> None:
    """Until /readyz answers 200; the server's log in the error if it exits or takes 5 min."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and server.poll() is None:
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"prefixgate serve did not get ready:\n{log.read_text()[-3000:]}")
