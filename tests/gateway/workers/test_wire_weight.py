"""The tenant's scheduling weight crosses to a worker as the engine got it; a worker reads a
request without one (from an older gateway) as weight 1.0 and refuses one out of range."""

from __future__ import annotations

import json
import math

import pytest

from engine.request import GenerationRequest
from gateway.workers import wire


def across(request: GenerationRequest) -> GenerationRequest:
    """`request` as a worker reads it, through JSON text as it crosses."""
    text = json.dumps(wire.request_json(request))
    return wire.read_request(json.loads(text), compile_grammar=None)


@pytest.mark.parametrize("weight", [0.01, 0.3, 1.0, 2.5, 100.0])
def test_the_weight_crosses_unchanged(weight: float) -> None:
    assert across(GenerationRequest("r", "acme", [1, 2, 3], weight=weight)).weight == weight


def test_a_request_from_a_gateway_that_sends_no_weight_weighs_one() -> None:
    older = wire.request_json(GenerationRequest("r", "acme", [1, 2, 3], weight=4.0))
    del older["weight"]
    assert wire.read_request(older, compile_grammar=None).weight == 1.0


@pytest.mark.parametrize(
    "weight", [0, 0.001, -1.0, 100.5, math.inf, math.nan, "2", None, True, [1.0]]
)
def test_a_weight_that_no_tenant_may_have_is_refused(weight: object) -> None:
    good = wire.request_json(GenerationRequest("r", "acme", [1, 2, 3]))
    with pytest.raises(wire.WireError, match="weight"):
        wire.read_request({**good, "weight": weight}, compile_grammar=None)
