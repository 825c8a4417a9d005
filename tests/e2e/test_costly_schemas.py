"""A tenant's costly response_format schemas are refused within the compile limit and slow no
other tenant: grammars compile after the shared preparation slots, one at a time per tenant.

On a gateway with one preparation slot, so that a grammar compiling inside it would stall
every other tenant's request behind it.
"""

from __future__ import annotations

import random
import string
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest

from tenancy.tenants import TenantLimits
from tests.support.gateway import MODEL, Gateway, openai_client, start_gateway

# Declared names beside undeclared ones: seconds of xgrammar's time, far past the limit.
_names = random.Random(1)
COSTLY_SCHEMA = {
    "type": "object",
    "properties": {
        "".join(_names.choices(string.ascii_letters, k=12)): {"type": "string"} for _ in range(60)
    },
    "additionalProperties": True,
}
ATTACKS = 3


@pytest.fixture(scope="module")
def one_slot_gateway(
    migrated_template: str, tiny_chat_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    tenants = [("acme", "user", TenantLimits()), ("globex", "user", TenantLimits())]
    with start_gateway(
        migrated_template,
        tiny_chat_dir,
        tmp_path_factory.mktemp("costly-schemas"),
        tenants,
        prepare_concurrency=1,
        grammar_compile_timeout_s=1.0,
    ) as started:
        yield started


def costly(client: openai.OpenAI) -> tuple[float, Any]:
    """A chat request with the costly schema: when its answer came, and the error."""
    try:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "a JSON object"}],
            max_tokens=8,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "costly", "schema": COSTLY_SCHEMA},
            },
        )
    except openai.APIStatusError as error:
        return time.monotonic(), error
    return time.monotonic(), None


def test_a_tenants_costly_schemas_are_refused_and_leave_other_tenants_unslowed(
    one_slot_gateway: Gateway,
) -> None:
    attacker = openai_client(one_slot_gateway, "acme")
    neighbour = openai_client(one_slot_gateway, "globex")
    with ThreadPoolExecutor(ATTACKS) as pool:
        attacks = [pool.submit(costly, attacker) for _ in range(ATTACKS)]
        time.sleep(0.5)  # the attacks are in, and the first is compiling
        plain = neighbour.completions.create(model=MODEL, prompt="hello", max_tokens=1)
        answered = time.monotonic()
        results = [attack.result(timeout=120) for attack in attacks]
    assert plain.choices[0].text is not None
    # The attacker's compiles run one after another, outside the one shared slot: the
    # neighbour's request was answered before the last of them, not queued behind them all.
    assert answered < max(when for when, _ in results)
    for _, error in results:
        assert error is not None and error.status_code == 400, error
        body = error.body if isinstance(error.body, dict) else {}
        assert body.get("param") == "response_format", body
        assert "too costly to compile within 1 s" in str(body.get("message")), body
