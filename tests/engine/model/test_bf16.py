"""bf16 weights and KV (the default where the CPU computes bf16 natively): how far from fp32,
and I1 in bf16 on the embedded model.

Tolerance, measured on these prompts: the last position's logits stay within 1.0 of fp32's
(their standard deviation is about 3.4; the largest difference seen was 0.65), the top token is
the same and the top five agree in at least four.

Where the CPU has bf16 matrix units, cached and uncached runs are the same bits, not only the
same greedy tokens: a cached block holds exactly the bf16 K/V an uncached prefill writes, a
prompt's remaining tokens take the same attention path at any length (matrix products), and
every projection sums in one order whatever else shares the step (`MatrixLinear`). The last
also keeps a request's logits free of other tenants' requests in its steps.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.attention.selection import make_backend
from engine.cache.block_pool import BlockPool
from engine.cache.kv_spec import KVSpec
from engine.config import EngineConfig
from engine.engine import Engine
from engine.model.loader import LoadedModel, load_model
from engine.model.runner import Chunk, ModelRunner
from engine.precision import parse_cpuinfo, resolve_dtype
from tests.support.models import make_request, run_one

SYSTEM = "You are a helpful assistant for an online bookshop. Answer briefly and politely. " * 4
QUESTIONS = [
    "What is the capital of France?",
    "Recommend a novel about the sea.",
    "How do I return a book?",
    "Write a haiku about autumn.",
]
MAX_LOGIT_DIFFERENCE = 1.0
CPU = torch.device("cpu")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2_bf16() -> LoadedModel:
    return load_model(dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer: Any) -> list[list[int]]:
    rendered = []
    for question in QUESTIONS:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        ids = smollm2_tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True
        )
        rendered.append(list(ids["input_ids"] if not isinstance(ids, list) else ids))
    return rendered


def runner_for(loaded: LoadedModel, blocks: int = 16) -> ModelRunner:
    dtype = loaded.model.dtype
    spec = KVSpec(loaded.num_layers, loaded.num_kv_heads, loaded.head_dim, dtype, 16)
    backend = make_backend("cpu", CPU, loaded.head_dim)
    return ModelRunner(loaded.model, BlockPool(spec, blocks).kv, backend)


def last_logits(loaded: LoadedModel, prompt: list[int]) -> torch.Tensor:
    chunk = Chunk("probe", prompt, 0, list(range(16)), len(prompt), needs_logits=True)
    return runner_for(loaded).run([chunk])[0]


def needs_matrix_units(runner: ModelRunner) -> None:
    if not runner.matrix_linears:  # what the engine reports as "linear_kernel": "matrix"
        pytest.skip("this CPU has no bf16 matrix micro-kernels")


def common_prefix(first: list[int], second: list[int]) -> int:
    length = 0
    while length < min(len(first), len(second)) and first[length] == second[length]:
        length += 1
    return length


def test_bf16_logits_stay_close_to_fp32(
    smollm2: LoadedModel, smollm2_bf16: LoadedModel, prompts: list[list[int]]
) -> None:
    for prompt in prompts:
        reference, approximate = last_logits(smollm2, prompt), last_logits(smollm2_bf16, prompt)
        assert (reference - approximate).abs().max() <= MAX_LOGIT_DIFFERENCE
        assert reference.argmax() == approximate.argmax()
        top_reference = set(reference.topk(5).indices.tolist())
        assert len(top_reference & set(approximate.topk(5).indices.tolist())) >= 4


def test_bf16_logits_are_summed_and_returned_in_fp32(smollm2_bf16: LoadedModel) -> None:
    # A bf16 head would round logits near 25 to steps of 0.125 and decide near-ties by that.
    engine = Engine(smollm2_bf16, EngineConfig(num_blocks=16))
    needs_matrix_units(engine.runner)
    assert engine.describe()["logits_dtype"] == "float32"
    assert engine.describe()["linear_kernel"] == "matrix"
    head = smollm2_bf16.model.lm_head
    hidden = torch.randn(5, head.in_features, generator=torch.Generator().manual_seed(0))
    hidden = hidden.to(torch.bfloat16)
    logits = head(hidden)
    assert logits.dtype == torch.float32
    exact = hidden.double() @ head.weight.double().T
    assert (logits.double() - exact).abs().max() < 1e-4
    rounded = exact.to(torch.bfloat16).double()
    assert (rounded - exact).abs().max() > 1e-2  # what a bf16 output would have lost


def test_bf16_greedy_output_is_the_same_with_and_without_the_cache(
    smollm2_bf16: LoadedModel, prompts: list[list[int]]
) -> None:
    cached = Engine(smollm2_bf16, EngineConfig(num_blocks=256))
    uncached = Engine(smollm2_bf16, EngineConfig(num_blocks=256, enable_prefix_caching=False))
    assert cached.describe()["dtype"] == "bfloat16"
    needs_matrix_units(cached.runner)
    for index, prompt in enumerate(prompts):
        hit = run_one(cached, make_request(f"cached-{index}", prompt, max_tokens=24))
        if index:  # the shared system prompt's whole blocks come from the cache
            shared = common_prefix(prompts[0], prompt) // 16 * 16
            assert shared > 0
            assert hit.usage.cached_tokens == shared
        alone = run_one(uncached, make_request(f"uncached-{index}", prompt, max_tokens=24))
        assert hit.token_ids == alone.token_ids


def test_a_prompt_computes_the_same_bits_whether_its_beginning_was_cached(
    smollm2_bf16: LoadedModel, prompts: list[list[int]]
) -> None:
    # The way a cache hit computes a prompt: its first blocks in an earlier step, then the
    # rest (here 1, 6 and 22 tokens, and a cut mid-block), against one prefill of it.
    probe = runner_for(smollm2_bf16)
    needs_matrix_units(probe)
    prompt, blocks = prompts[1], list(range(16))
    whole = probe.run([Chunk("whole", prompt, 0, blocks, len(prompt), needs_logits=True)])[0]
    for rest in (1, 6, 22, len(prompt) - 40):
        runner = runner_for(smollm2_bf16)
        cut = len(prompt) - rest
        runner.run([Chunk("first", prompt[:cut], 0, blocks, cut, needs_logits=False)])
        after = runner.run([Chunk("rest", prompt[cut:], cut, blocks, rest, needs_logits=True)])
        assert torch.equal(after[0], whole), rest


def test_a_requests_logits_do_not_depend_on_what_shares_its_step(
    smollm2_bf16: LoadedModel, prompts: list[list[int]]
) -> None:
    # A decoding request alone, then beside another tenant's prefill of 40 or 200 tokens, which
    # puts that many more rows through every projection of the step: the same bits. (On the
    # projections this replaced, torch's `linear` gave other bits beside the 40-token prefill
    # and oneDNN's packed matmul beside the 200-token one.)
    runner = runner_for(smollm2_bf16, blocks=32)
    needs_matrix_units(runner)
    prompt, own = prompts[0], list(range(8))
    runner.run([Chunk("a", prompt, 0, own, len(prompt), needs_logits=False, share_group="t1")])
    decode = Chunk("a", [504], len(prompt), own, 0, needs_logits=True, share_group="t1")
    alone = runner.run([decode])[0]
    for length in (40, 200):
        other = (prompts[2] * 3)[:length]
        neighbour = Chunk("b", other, 0, list(range(16, 32)), length, True, share_group="t2")
        beside = runner.run([decode, neighbour])
        assert torch.equal(beside[0], alone), length


def test_auto_dtype_follows_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine import precision

    monkeypatch.setattr(precision, "cpu_flags", lambda: frozenset({"avx2", "avx512_bf16"}))
    assert resolve_dtype("auto") == torch.bfloat16
    monkeypatch.setattr(precision, "cpu_flags", lambda: frozenset({"avx2", "amx_bf16"}))
    assert resolve_dtype("auto") == torch.bfloat16
    monkeypatch.setattr(precision, "cpu_flags", lambda: frozenset({"avx2", "avx512f"}))
    assert resolve_dtype("auto") == torch.float32
    assert resolve_dtype("bfloat16") == torch.bfloat16
    assert resolve_dtype("float32") == torch.float32
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("fp8")


X86_CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model name\t: AMD EPYC
flags\t\t: fpu avx2 avx512f avx512_bf16

processor\t: 1
vendor_id\t: AuthenticAMD
cpu family\t: 25
flags\t\t: fpu
"""


def test_cpuinfo_gives_the_first_cpus_fields() -> None:
    info = parse_cpuinfo(X86_CPUINFO)
    assert info["vendor_id"] == "AuthenticAMD" and info["cpu family"] == "25"
    assert info["flags"] == "fpu avx2 avx512f avx512_bf16"  # the first CPU's, not the last's
    assert parse_cpuinfo("\n\n" + X86_CPUINFO) == info  # blank lines before it: skipped
    arm64 = "processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd bf16\n\nprocessor\t: 1\n"
    assert parse_cpuinfo(arm64)["Features"] == "fp asimd bf16"
    # 32-bit ARM kernels list Features once, after every CPU's block.
    arm32 = "processor\t: 0\nBogoMIPS\t: 38.40\n\nprocessor\t: 1\n\nFeatures\t: half thumb neon\n"
    assert parse_cpuinfo(arm32)["Features"] == "half thumb neon"
    assert parse_cpuinfo("") == {}
