"""Schemathesis against the app's own OpenAPI spec: no 5xx, every response as documented.

A dedicated gateway (a tiny model, at most 4 output tokens, limits no run reaches) answers a few
hundred generated requests, valid and invalid, sent with a valid key.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import (
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from tenancy.tenants import TenantLimits
from tests.support.gateway import start_gateway

EXAMPLES_PER_OPERATION = 60
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    negative_data_rejection,
]


@pytest.fixture(scope="module")
def fuzzed_gateway(
    migrated_template: str, tiny_chat_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, str]]:
    limits = TenantLimits(requests_per_minute=100_000, tokens_per_minute=10**9,
                          max_concurrent=100)  # fmt: skip
    state_dir = tmp_path_factory.mktemp("fuzz-state")
    with start_gateway(migrated_template, tiny_chat_dir, state_dir, [("fuzz", "user", limits)],
                       max_output_tokens=4, max_prompt_tokens=512) as started:  # fmt: skip
        yield started.server.url, started.keys["fuzz"]


def test_every_response_is_documented_and_none_is_a_server_error(
    fuzzed_gateway: tuple[str, str],
) -> None:
    url, key = fuzzed_gateway
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.label for op in operations} >= {"POST /v1/chat/completions", "GET /v1/models"}
    calls = 0
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, derandomize=True,
                  suppress_health_check=list(HealthCheck), database=None)  # fmt: skip
        def conforms(case: schemathesis.Case) -> None:
            nonlocal calls
            calls += 1
            case.call_and_validate(base_url=url, headers={"Authorization": f"Bearer {key}"},
                                   checks=CHECKS, timeout=60)  # fmt: skip

        conforms()
    assert calls >= 3 * EXAMPLES_PER_OPERATION  # a real run, not a handful of cases
