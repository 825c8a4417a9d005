"""bench.fairness' server: a real `prefixgate serve` in a process of its own, with one
scheduling mode, the bench's tenants, an operator to change their weights through the admin
API, and the metrics token that shows per-tenant series on /metrics. See bench/fairness.py.
"""

from __future__ import annotations

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

from bench.served_gateway import ServedTenant, served_tenants

OPERATOR = "fairness-bench"


@dataclass(frozen=True, slots=True)
class FairnessServer:
    """A running server: its URL, each tenant's API key and id (by slug), an operator's
    session token, the metrics token, and its /readyz as it answered once ready."""

    url: str
    keys: dict[str, str]
    tenant_ids: dict[str, str]
    admin_token: str
    metrics_token: str
    ready: dict[str, Any]

    def target_step_ms(self) -> float | None:
        """The engine's step target, where /readyz reports one (fair scheduling's cost model)."""
        step_cost = self.ready.get("engine", {}).get("step_cost") or {}
        target = step_cost.get("target_ms")
        return None if target is None else float(target)

    def set_weight(self, slug: str, weight: float) -> str | None:
        """Give a tenant a scheduling weight through the admin API; None once it holds, else
        why not (a server whose admin API has no weights yet answers 422)."""
        response = httpx.patch(
            f"{self.url}/admin/api/tenants/{self.tenant_ids[slug]}",
            json={"scheduling_weight": weight},
            headers={"Authorization": f"Bearer {self.admin_token}"},
            timeout=30,
        )
        if response.status_code != 200:
            answer = f"HTTP {response.status_code} {response.text[:300]}"
            return f"PATCH /admin/api/tenants/{{id}}: {answer}"
        if response.json().get("scheduling_weight") != weight:
            return (
                f"the tenant's scheduling_weight reads {response.json().get('scheduling_weight')}"
            )
        return None


@contextmanager
def fairness_server(
    model_dir: Path, settings: Mapping[str, str], slugs: Sequence[str], quota_blocks: int
) -> Iterator[FairnessServer]:
    """`prefixgate serve` with `settings` as `PREFIXGATE_*` variables, on fresh SQLite state
    in a directory of its own (so that an operator can be added beside the tenants)."""
    metrics_token = secrets.token_urlsafe(24)
    with tempfile.TemporaryDirectory(prefix="bench-fairness-") as scratch:
        state = Path(scratch)
        shared = {
            "STATE_DIR": scratch,
            "DATABASE_URL": f"sqlite:///{state / 'fairness.db'}",
            "METRICS_TOKEN": metrics_token,
        }
        tenants = [ServedTenant(slug) for slug in slugs]
        with served_tenants(model_dir, {**settings, **shared}, tenants, quota_blocks) as served:
            admin_token = _operator_session(served.url, state, shared)
            listed = httpx.get(
                f"{served.url}/admin/api/tenants",
                headers={"Authorization": f"Bearer {admin_token}"},
                params={"limit": 500},
                timeout=30,
            )
            listed.raise_for_status()
            yield FairnessServer(
                url=served.url,
                keys={slug: served.keys[slug][0] for slug in slugs},
                tenant_ids={row["slug"]: row["id"] for row in listed.json()["data"]},
                admin_token=admin_token,
                metrics_token=metrics_token,
                ready=served.ready,
            )


def _operator_session(url: str, state: Path, shared: Mapping[str, str]) -> str:
    """Create an operator with the CLI (as an operator would), log in, return the token."""
    password = secrets.token_urlsafe(24)
    password_file = state / "operator-password"
    password_file.write_text(password)
    env = {**os.environ, **{f"PREFIXGATE_{name}": value for name, value in shared.items()}}
    cli = str(Path(sys.executable).with_name("prefixgate"))
    subprocess.run(
        [cli, "admins", "create", OPERATOR, "--password-file", str(password_file)],
        env=env,
        cwd=state,
        check=True,
        capture_output=True,
    )
    login = httpx.post(
        f"{url}/admin/api/login", json={"username": OPERATOR, "password": password}, timeout=30
    )
    login.raise_for_status()
    return str(login.json()["token"])
