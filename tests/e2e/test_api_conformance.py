"""Schemathesis against the app's own OpenAPI spec: no 5xx, every response as documented.

A dedicated gateway (a tiny model, at most 4 output tokens, limits no run reaches) answers a few
hundred generated requests, valid and invalid: the /v1 routes with a valid inference key, the
admin API with a real admin session (logged in on that gateway), so that the fuzzer reaches
past the guard. Ids in admin paths are random, so changes to a named resource answer 404 and
the fuzz tenant survives the run.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.core.failures import FailureGroup
from schemathesis.core.result import Err, Ok
from schemathesis.schemas import APIOperation

from tenancy.tenants import TenantLimits
from tests.support.gateway import ADMIN_PASSWORD, ADMIN_USER, start_gateway

EXAMPLES_PER_OPERATION = 60
# The admin API has many more operations, each a few database round trips: fewer examples
# each keep the run to a minute or two on two cores.
EXAMPLES_PER_ADMIN_OPERATION = 15
NEGATIVE_EXAMPLES_PER_ADMIN_OPERATION = 10
ADMIN_PATHS = "/admin/api/"
# Logging out ends the session every other admin call uses: it is fuzzed last.
LOGOUT = "POST /admin/api/logout"
Operation = APIOperation[Any, Any, Any, Any]
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    negative_data_rejection,
]


@dataclass(frozen=True, slots=True)
class FuzzedGateway:
    url: str
    inference_key: str
    admin_token: str


@pytest.fixture(scope="module")
def fuzzed_gateway(
    migrated_template: str, tiny_chat_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[FuzzedGateway]:
    limits = TenantLimits(requests_per_minute=100_000, tokens_per_minute=10**9,
                          max_concurrent=100)  # fmt: skip
    state_dir = tmp_path_factory.mktemp("fuzz-state")
    with start_gateway(migrated_template, tiny_chat_dir, state_dir, [("fuzz", "user", limits)],
                       max_output_tokens=4, max_prompt_tokens=512) as started:  # fmt: skip
        login = httpx.post(
            f"{started.admin_url}/login", json={"username": ADMIN_USER, "password": ADMIN_PASSWORD}
        )
        assert login.status_code == 200, login.text
        yield FuzzedGateway(started.server.url, started.keys["fuzz"], login.json()["token"])


def test_every_response_is_documented_and_none_is_a_server_error(
    fuzzed_gateway: FuzzedGateway,
) -> None:
    schema = schemathesis.openapi.from_url(f"{fuzzed_gateway.url}/openapi.json")
    # The credential is ours to send (the right one for each side): the fuzzer neither drops
    # nor invents it, or a "missing Authorization" case would be answered with ours.
    schema.config.generation.update(with_security_parameters=False)
    results = list(schema.get_all_operations())
    assert not [result.err() for result in results if isinstance(result, Err)]
    operations = sorted(
        (result.ok() for result in results if isinstance(result, Ok)),
        key=lambda op: op.label == LOGOUT,
    )
    labels = {op.label for op in operations}
    assert {"POST /v1/chat/completions", "GET /v1/models", "GET /admin/api/tenants"} <= labels
    statuses = {"api": Counter[int](), "admin": Counter[int]()}
    failures: list[str] = []
    for operation in operations:
        side = "admin" if operation.path.startswith(ADMIN_PATHS) else "api"
        try:
            statuses[side] += _fuzz(fuzzed_gateway, operation, GenerationMode.POSITIVE)
            if side == "admin":  # strict bodies: whatever is wrong in a request is a 4xx
                statuses[side] += _fuzz(fuzzed_gateway, operation, GenerationMode.NEGATIVE)
        except (Exception, FailureGroup) as failure:  # every failing operation, not the first
            failures.append(f"{operation.label}:\n{failure}")
    assert not failures, "\n\n".join(failures)
    # A real run, not a handful of cases, on both sides of the spec; and the admin calls got
    # past the guard (a fuzzer that only ever hears 401 checks nothing).
    assert statuses["api"].total() >= 3 * EXAMPLES_PER_OPERATION
    assert statuses["admin"].total() >= 10 * EXAMPLES_PER_ADMIN_OPERATION
    assert statuses["admin"][200] + statuses["admin"][201] >= 2 * EXAMPLES_PER_ADMIN_OPERATION


def _fuzz(fuzzed: FuzzedGateway, operation: Operation, mode: GenerationMode) -> Counter[int]:
    """Send the operation's generated cases; the statuses they got. Raises the first failure."""
    admin = operation.path.startswith(ADMIN_PATHS)
    examples = EXAMPLES_PER_ADMIN_OPERATION if admin else EXAMPLES_PER_OPERATION
    if mode is GenerationMode.NEGATIVE:
        examples = NEGATIVE_EXAMPLES_PER_ADMIN_OPERATION
    credential = fuzzed.admin_token if admin else fuzzed.inference_key
    statuses = Counter[int]()

    @given(case=operation.as_strategy(mode))
    @settings(max_examples=examples, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck), database=None)  # fmt: skip
    def conforms(case: schemathesis.Case[Operation]) -> None:
        response = case.call_and_validate(
            base_url=fuzzed.url,
            headers={"Authorization": f"Bearer {credential}"},
            checks=CHECKS,
            timeout=60,
        )
        statuses[response.status_code] += 1

    try:
        conforms()
    except Unsatisfiable:
        # Nothing in the operation can be made invalid (no parameters, no body): nothing to send.
        if mode is not GenerationMode.NEGATIVE:
            raise
    return statuses
