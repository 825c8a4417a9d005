"""Tiny seeded causal LMs of each architecture the engine must run, and engines over them."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from engine.cache.scope import CacheScope, Segment, User
from engine.config import EngineConfig
from engine.engine import Engine
from engine.model.loader import LoadedModel
from engine.request import GenerationDelta, GenerationRequest, Usage
from engine.sampling.sampler import SamplingParams
from engine.step_cost import StepCost

VOCAB = 512
_COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
}


def _llama() -> PreTrainedModel:
    return LlamaForCausalLM(LlamaConfig(**_COMMON))


def _qwen2() -> PreTrainedModel:
    return Qwen2ForCausalLM(Qwen2Config(**_COMMON))


def _mistral() -> PreTrainedModel:
    # A short sliding window, so the window really cuts into the tests' contexts.
    return MistralForCausalLM(MistralConfig(**_COMMON, sliding_window=48))


ARCHITECTURES: dict[str, Callable[[], PreTrainedModel]] = {
    "llama": _llama,
    "qwen2": _qwen2,
    "mistral": _mistral,
}


# Where tests run the Triton backend: the GPU when torch sees one, else the CPU in Triton's
# interpreter (tests/conftest.py sets TRITON_INTERPRET=1 then).
TRITON_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def tiny_model(architecture: str, seed: int = 0) -> PreTrainedModel:
    """A small random model; the same seed gives the same weights."""
    torch.manual_seed(seed)
    model = ARCHITECTURES[architecture]()
    return model.eval()


def reference_copy(model: PreTrainedModel) -> PreTrainedModel:
    """The same weights running transformers' own sdpa attention (separate config object)."""
    reference = type(model)(copy.deepcopy(model.config))
    reference.load_state_dict(model.state_dict())
    reference.config._attn_implementation = "sdpa"
    return reference.eval()


def loaded(model: PreTrainedModel, name: str = "tiny") -> LoadedModel:
    return LoadedModel(model, None, name, f"fingerprint-{name}", (), 2048)


# A cost model under which no step of these tests' sizes reaches the step-time target: their
# steps are as the token budget and the tenants' shares make them, the same on every machine
# (tests of the time cap give their own).
FLAT_COST = StepCost(fixed_ms=1.0, per_token_ms=0.001, per_context_ms=0.0)


def engine_for(
    architecture: str, seed: int = 0, device: torch.device | str = "cpu", **config: object
) -> Engine:
    """An engine (not started: tests drive `step()`) over a fresh tiny model on `device`."""
    options: dict[str, object] = {"block_size": 16, "num_blocks": 256, "step_cost": FLAT_COST}
    options.update(config)
    model = tiny_model(architecture, seed).to(device)  # type: ignore[arg-type]
    return Engine(loaded(model, architecture), EngineConfig(**options))  # type: ignore[arg-type]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0)


def make_request(
    request_id: str,
    tokens: Sequence[int],
    tenant: str = "t1",
    user: str = "u1",
    max_tokens: int = 8,
    sampling: SamplingParams | None = None,
    scope: CacheScope | None = None,
    segments: Sequence[Segment] = (),
) -> GenerationRequest:
    return GenerationRequest(
        request_id=request_id,
        tenant_id=tenant,
        prompt_token_ids=list(tokens),
        sampling=sampling or greedy(max_tokens),
        segments=segments,
        tail_scope=scope or User(tenant, user),
    )


class Collector:
    """A sink that records what the engine streams for one request."""

    def __init__(self) -> None:
        self.deltas: list[GenerationDelta] = []
        self.error: Exception | None = None

    def __call__(self, item: GenerationDelta | Exception) -> None:
        if isinstance(item, Exception):
            self.error = item
        else:
            self.deltas.append(item)

    @property
    def done(self) -> bool:
        return self.error is not None or bool(self.deltas and self.deltas[-1].finish_reason)

    @property
    def token_ids(self) -> list[int]:
        return [token for delta in self.deltas for token in delta.token_ids]

    @property
    def text(self) -> str:
        return "".join(delta.text for delta in self.deltas)

    @property
    def usage(self) -> Usage:
        usage = self.deltas[-1].usage
        assert usage is not None
        return usage


def run_all(engine: Engine, requests: Sequence[GenerationRequest]) -> list[Collector]:
    """Submit all requests at once and step the engine until every one is done."""
    collectors = []
    for request in requests:
        collector = Collector()
        engine.submit(request, collector)
        collectors.append(collector)
    for _ in range(100_000):
        if not engine.step():
            break
    assert all(collector.done for collector in collectors)
    return collectors


def run_one(engine: Engine, request: GenerationRequest) -> Collector:
    return run_all(engine, [request])[0]
