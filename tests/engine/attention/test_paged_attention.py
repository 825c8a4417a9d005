"""The paged path computes what transformers' own sdpa forward computes (fp32, atol 1e-4), with
each attention backend: the torch reference, the C++ CPU kernel and the Triton kernels."""

from __future__ import annotations

import pytest
import torch

from engine.attention.cpu_backend import CpuAttention
from engine.attention.paged import AttentionBackend
from engine.attention.selection import make_backend
from engine.attention.torch_backend import TorchAttention
from engine.cache.block_pool import BlockPool
from engine.cache.kv_spec import KVSpec
from engine.model.runner import Chunk, ModelRunner
from tests.engine.prompts import tokens as random_tokens
from tests.support.models import ARCHITECTURES, TRITON_DEVICE, reference_copy, tiny_model

BLOCK_SIZE = 16
ATOL = 1e-4
BACKENDS = ["torch", "cpu", "triton"]  # triton: in the interpreter without a GPU


def reference_logits(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([tokens])).logits[0].float()


def runner_for(model: torch.nn.Module, backend: str = "torch") -> ModelRunner:
    config = model.config
    spec = KVSpec(
        config.num_hidden_layers,
        config.num_key_value_heads,
        config.hidden_size // config.num_attention_heads,
        torch.float32,
        BLOCK_SIZE,
    )
    device = TRITON_DEVICE if backend == "triton" else torch.device("cpu")
    attention = make_backend(backend, device, spec.head_dim)
    assert attention.name == backend
    return ModelRunner(model.to(device), BlockPool(spec, 64, device).kv, attention)


def chunk(name: str, tokens: list[int], start: int, end: int, blocks: list[int]) -> Chunk:
    return Chunk(name, tokens[start:end], start, blocks, end - start, needs_logits=True)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_chunked_prefill_then_decode_matches_sdpa(architecture: str, backend: str) -> None:
    model = tiny_model(architecture)
    reference = reference_logits(reference_copy(model), tokens := random_tokens(0, 90))
    runner = runner_for(model, backend)
    blocks = [5, 2, 9, 11, 3, 7]  # deliberately scattered
    # Three prefill chunks ending mid-block, then decode steps one token at a time.
    position = 0
    for end in (23, 50, 80, *range(81, 91)):
        logits = runner.run([chunk("a", tokens, position, end, blocks)])
        torch.testing.assert_close(logits[0].cpu(), reference[end - 1], atol=ATOL, rtol=0)
        position = end


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_packed_varlen_batch_matches_sdpa_per_sequence(architecture: str, backend: str) -> None:
    model = tiny_model(architecture)
    reference_model = reference_copy(model)
    runner = runner_for(model, backend)
    first, second, third = random_tokens(1, 70), random_tokens(2, 33), random_tokens(3, 52)
    tables = {"a": [0, 1, 2, 3, 4], "b": [10, 11, 12], "c": [20, 21, 22, 23]}
    # Prefill a and b partly, then one step mixing: a decode, b's prefill chunk, c's prefill.
    runner.run([chunk("a", first, 0, 69, tables["a"]), chunk("b", second, 0, 17, tables["b"])])
    logits = runner.run(
        [
            chunk("a", first, 69, 70, tables["a"]),
            chunk("b", second, 17, 33, tables["b"]),
            chunk("c", third, 0, 52, tables["c"]),
        ]
    )
    for row, tokens in enumerate((first, second, third)):
        expected = reference_logits(reference_model, tokens)[-1]
        torch.testing.assert_close(logits[row].cpu(), expected, atol=ATOL, rtol=0)


def test_runner_counts_the_positions_it_computes() -> None:
    runner = runner_for(tiny_model("llama"))
    tokens = random_tokens(4, 40)
    runner.run([Chunk("a", tokens[16:40], 16, [0, 1, 2], 24, needs_logits=True)])
    assert runner.computed_tokens == 24
    runner.run([Chunk("a", tokens[16:20], 16, [0, 1, 2], 4, needs_logits=True)])  # recomputed
    assert runner.computed_tokens == 28
    assert runner.pop_computed_prompt_positions("a") == 24


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_reads_only_the_sequences_own_blocks(backend: str) -> None:
    model = tiny_model("llama")
    reference_model = reference_copy(model)
    runner = runner_for(model, backend)
    short, long = random_tokens(5, 10), random_tokens(6, 40)
    tables = {"short": [7], "long": [4, 5, 6]}
    runner.run([chunk("short", short, 0, 9, tables["short"])])
    runner.run([chunk("long", long, 0, 39, tables["long"])])
    # Block 0 belongs to nobody here; another sequence's failed step may have left NaN in it.
    runner.kv_cache[:, :, 0] = float("nan")
    # One decode batch of different lengths: the short row is padded to the long one's blocks.
    logits = runner.run(
        [chunk("short", short, 9, 10, tables["short"]), chunk("long", long, 39, 40, tables["long"])]
    )
    for row, tokens in enumerate((short, long)):
        expected = reference_logits(reference_model, tokens)[-1]
        torch.testing.assert_close(logits[row].cpu(), expected, atol=ATOL, rtol=0)


def test_a_forward_that_raises_records_nothing() -> None:
    model = tiny_model("llama")
    runner = runner_for(model)
    tokens = random_tokens(7, 20)

    def fail(*_: object) -> None:
        raise RuntimeError("injected fault")

    hook = model.get_input_embeddings().register_forward_pre_hook(fail)
    with pytest.raises(RuntimeError, match="injected fault"):
        runner.run([chunk("a", tokens, 0, 20, [0, 1])])
    hook.remove()
    assert runner.computed_tokens == 0
    assert runner.pop_computed_prompt_positions("a") == 0


def test_auto_picks_the_cpu_kernel_and_falls_back_to_torch_where_it_cannot_serve() -> None:
    cpu = torch.device("cpu")
    chosen: AttentionBackend = make_backend("auto", cpu, 64)
    assert isinstance(chosen, CpuAttention)
    assert isinstance(make_backend("torch", cpu, 64), TorchAttention)
    # A head size the kernel does not handle: auto falls back, an explicit "cpu" refuses.
    assert isinstance(make_backend("auto", cpu, 24), TorchAttention)
    with pytest.raises(ValueError, match="head_dim 24"):
        make_backend("cpu", cpu, 24)
    with pytest.raises(ValueError, match="unknown attention backend"):
        make_backend("flash", cpu, 64)


def test_each_tenant_is_a_share_group_of_its_own() -> None:
    # The CPU kernel lets decodes of one share group read the blocks their tables share
    # together; a tenant's chunks must never be in another tenant's group, and a chunk with no
    # group in none.
    runner = runner_for(tiny_model("llama"))
    chunks = [
        Chunk(f"r{index}", [3], 20, [1, 2], 0, True, share_group=tenant)
        for index, tenant in enumerate(["acme", "globex", "acme", None, "globex"])
    ]
    batch, *_ = runner._batch(chunks)
    assert batch.share_groups is not None
    assert batch.share_groups.dtype == torch.int32
    assert batch.share_groups.tolist() == [0, 1, 0, -1, 1]
