"""A real `prefixgate serve` in a subprocess, for benchmarks that go through the HTTP API.

Its own process (its own GIL), a temporary state directory with SQLite, and tenants, keys and
public prefixes made with the CLI, as an operator would.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.local_server import free_port, wait_until_ready
from bench.local_workers import ServerProcess, stop

PUBLIC_NAMESPACE = "default"  # in the packaged policy's namespaces


@dataclass(frozen=True, slots=True)
class ServedTenant:
    """A tenant to create, with this many inference keys; limits no benchmark reaches."""

    slug: str
    keys: int = 1


@dataclass(frozen=True, slots=True)
class ServedGateway:
    """A running server: its URL, each tenant's API keys (by slug, in creation order) and its
    /readyz as the metrics scraper saw it once ready (the engine's description)."""

    url: str
    keys: dict[str, list[str]]
    ready: dict[str, Any]


@contextmanager
def served_gateway(
    model_dir: Path,
    kv_cache_bytes: int,
    dtype: str,
    quota_blocks: int,
    max_num_seqs: int,
    tenant: str,
) -> Iterator[ServedGateway]:
    """`prefixgate serve` on a free port with fresh SQLite state and one tenant whose limits
    no benchmark reaches."""
    settings = {
        "KV_CACHE_BYTES": str(kv_cache_bytes),
        "DTYPE": dtype,
        "MAX_NUM_SEQS": str(max_num_seqs),
    }
    with served_tenants(model_dir, settings, [ServedTenant(tenant)], quota_blocks) as served:
        yield served


@contextmanager
def served_tenants(
    model_dir: Path,
    settings: Mapping[str, str],
    tenants: Sequence[ServedTenant],
    quota_blocks: int,
    public_prefixes: Mapping[str, str] | None = None,
) -> Iterator[ServedGateway]:
    """`prefixgate serve` on a free port with fresh SQLite state, `settings` as `PREFIXGATE_*`
    variables (`{"DTYPE": "float32"}`), these user-scoped tenants, and `public_prefixes`
    (name -> system prompt text) registered for the model in the default namespace."""
    cli = str(Path(sys.executable).with_name("prefixgate"))
    # /readyz describes the engine only to the metrics scraper.
    settings = {"METRICS_TOKEN": secrets.token_urlsafe(24), **settings}
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as scratch:
        state, port = Path(scratch), free_port()
        env = {
            **os.environ,
            "PREFIXGATE_STATE_DIR": scratch,
            "PREFIXGATE_DATABASE_URL": f"sqlite:///{state / 'bench.db'}",
            "PREFIXGATE_MODEL_DIR": str(model_dir),
            **{f"PREFIXGATE_{name}": value for name, value in settings.items()},
        }

        def cli_json(*arguments: str) -> Any:
            done = subprocess.run(
                [cli, *arguments, "--json"],
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
        keys: dict[str, list[str]] = {}
        for tenant in tenants:
            cli_json(
                "tenants", "create", tenant.slug, "--quota", str(quota_blocks),
                "--rpm", "100000", "--tpm", str(10**9), "--concurrent", "1000",
            )  # fmt: skip
            keys[tenant.slug] = [
                cli_json("keys", "create", "--tenant", tenant.slug)["key"]
                for _ in range(tenant.keys)
            ]
        model_name = settings.get("SERVED_MODEL_NAME", model_dir.name)  # as the server names it
        for name, text in (public_prefixes or {}).items():
            text_file = state / f"prefix-{name}.txt"
            text_file.write_text(text, encoding="utf-8")
            cli_json(
                "prefixes", "add", "--model", model_name, "--namespace", PUBLIC_NAMESPACE,
                "--name", name, "--text-file", str(text_file),
            )  # fmt: skip
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
            wait_until_ready(url, server, log)
            scraper = {"Authorization": f"Bearer {settings['METRICS_TOKEN']}"}
            ready = httpx.get(f"{url}/readyz", headers=scraper, timeout=30).json()
            yield ServedGateway(url, keys, ready)
        finally:
            stop(server)


GatewayProcess = ServerProcess  # a `prefixgate serve`


@contextmanager
def gateway_process(
    settings: Mapping[str, str], log_dir: Path, start_timeout_s: float = 300.0
) -> Iterator[GatewayProcess]:
    """`prefixgate serve` on a free localhost port with `settings` as `PREFIXGATE_*` variables
    (`{"DATABASE_URL": ...}`), ready when yielded (its /readyz answers 200); stopped after."""
    cli = str(Path(sys.executable).with_name("prefixgate"))
    port = free_port()
    env = {**os.environ, **{f"PREFIXGATE_{name}": value for name, value in settings.items()}}
    log = log_dir / f"gateway-{port}.log"
    with open(log, "wb") as output:
        process = subprocess.Popen(
            [cli, "serve", "--host", "127.0.0.1", "--port", str(port)],
            env=env, cwd=log_dir, stdout=output, stderr=subprocess.STDOUT,
        )  # fmt: skip
    gateway = GatewayProcess(process, f"http://127.0.0.1:{port}", log)
    try:
        wait_until_ready(gateway.url, process, log, start_timeout_s)
        yield gateway
    finally:
        stop(process)
