"""PrefixGate's own Llama forward (`cpu_decoder.py`) and its fused ops (`elementwise.cpp`).

The ops against the torch operators transformers runs (bf16: bit for bit, fp32: within 1e-5);
the decoder against transformers' own forward of the same model; the fused projections as
views, so the model's weights are held once and its `state_dict` is unchanged.
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from engine.attention.selection import make_backend
from engine.kernels.cpu import build as cpu_build
from engine.kernels.cpu.fused import FusedRMSNorm, fuse_elementwise
from engine.model.cpu_decoder import LlamaDecoder, llama_decoder
from engine.model.runner import Chunk, ModelRunner
from tests.support.models import reference_copy, tiny_model

cpu_build.load()
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 0.0}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


@DTYPES
def test_add_rms_norm_adds_in_place_then_normalizes_as_transformers_does(
    dtype: torch.dtype,
) -> None:
    generator = torch.Generator().manual_seed(1)
    norm = LlamaRMSNorm(96, eps=1e-6)
    norm.weight.data = torch.randn(96, generator=generator)
    norm = norm.to(dtype)
    residual = (torch.randn(9, 96, generator=generator) * 3).to(dtype)
    hidden = torch.randn(9, 96, generator=generator).to(dtype)
    expected_sum = residual + hidden
    expected = norm(expected_sum)
    normed = torch.ops.prefixgate.add_rms_norm_(residual, hidden, norm.weight, 1e-6)
    assert torch.equal(residual, expected_sum)  # the same rounded sum, in place
    torch.testing.assert_close(normed, expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@DTYPES
def test_gated_silu_on_a_fused_product_equals_silu_of_gate_times_up(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(2)
    gate_up = (torch.randn(7, 2 * 48, generator=generator) * 20).to(dtype)
    gate, up = gate_up[:, :48], gate_up[:, 48:]
    expected = torch.nn.functional.silu(gate) * up
    fused = torch.ops.prefixgate.gated_silu(gate_up)
    torch.testing.assert_close(fused, expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    apart = torch.ops.prefixgate.silu_and_mul(gate.contiguous(), up.contiguous())
    assert torch.equal(fused, apart)


@DTYPES
@pytest.mark.parametrize("head_dim", [16, 64, 128])  # element by element; one, two vectors
def test_rotary_rotates_queries_and_keys_in_place_and_leaves_values(
    dtype: torch.dtype, head_dim: int
) -> None:
    generator = torch.Generator().manual_seed(3)
    tokens, q_heads, kv_heads = 5, 4, 2
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim, generator=generator).to(dtype)
    angles = torch.rand(tokens, head_dim // 2, generator=generator) * 100
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(dtype)
    sin = torch.cat([angles.sin(), angles.sin()], -1).to(dtype)
    heads = qkv.view(tokens, -1, head_dim).transpose(0, 1)[None]  # [1, heads, tokens, dim]
    q, k = heads[:, :q_heads], heads[:, q_heads : q_heads + kv_heads]
    expected_q, expected_k = apply_rotary_pos_emb(q, k, cos[None], sin[None])
    values = qkv[:, (q_heads + kv_heads) * head_dim :].clone()
    torch.ops.prefixgate.rotary_(qkv, cos, sin, q_heads + kv_heads, head_dim)
    rotated = qkv.view(tokens, -1, head_dim).transpose(0, 1)[None]
    if dtype == torch.bfloat16:  # rounded where torch's ops round: the same bits
        assert torch.equal(rotated[:, :q_heads], expected_q)
        assert torch.equal(rotated[:, q_heads : q_heads + kv_heads], expected_k)
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(rotated[:, :q_heads], expected_q, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(
        rotated[:, q_heads : q_heads + kv_heads], expected_k, atol=tolerance, rtol=tolerance
    )
    assert torch.equal(qkv[:, (q_heads + kv_heads) * head_dim :], values)


def test_the_fused_ops_refuse_shapes_that_do_not_fit() -> None:
    qkv = torch.zeros(3, 128)
    table = torch.zeros(3, 32)
    with pytest.raises(RuntimeError, match="must fit"):
        torch.ops.prefixgate.rotary_(qkv, table, table, 5, 32)  # 160 > 128 columns
    with pytest.raises(RuntimeError, match="cos and sin"):
        torch.ops.prefixgate.rotary_(qkv, torch.zeros(2, 32), table, 2, 32)
    with pytest.raises(RuntimeError, match="residual"):
        torch.ops.prefixgate.add_rms_norm_(
            torch.zeros(2, 32), torch.zeros(3, 32), torch.ones(32), 1e-6
        )
    with pytest.raises(RuntimeError, match="halves"):
        torch.ops.prefixgate.gated_silu(torch.zeros(2, 48))


@DTYPES
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_the_own_forward_gives_transformers_logits_for_a_mixed_batch(
    dtype: torch.dtype, backend: str
) -> None:
    model = tiny_model("llama").to(dtype)
    reference = reference_copy(model)
    pool = torch.zeros(model.config.num_hidden_layers, 2, 32, 16, 2, 16, dtype=dtype)
    runner = ModelRunner(model, pool, make_backend(backend, torch.device("cpu"), 16))
    assert isinstance(runner.decoder, LlamaDecoder)
    first, second = list(range(3, 43)), list(range(100, 119))
    with torch.inference_mode():
        # One step: a 40-token prompt and a 19-token one, every position's logits.
        logits = runner.run([
            Chunk("a", first, 0, [0, 1, 2], 40, True, all_logits=True),
            Chunk("b", second, 0, [3, 4], 19, True, all_logits=True),
        ])  # fmt: skip
        # The next step: "a" decodes one token over its cached 40, "b" extends by 5.
        step = runner.run([
            Chunk("a", [7], 40, [0, 1, 2], 0, True),
            Chunk("b", [8, 9, 10, 11, 12], 19, [3, 4], 0, True),
        ])  # fmt: skip
        expected_a = reference(input_ids=torch.tensor([[*first, 7]])).logits[0]
        expected_b = reference(input_ids=torch.tensor([[*second, 8, 9, 10, 11, 12]])).logits[0]
    expected_a, expected_b = expected_a.float(), expected_b.float()
    # Logits here have a standard deviation of about 0.16; bf16 attention differs from sdpa.
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype]
    close = {"atol": tolerance, "rtol": tolerance}
    torch.testing.assert_close(logits[:40], expected_a[:40], **close)
    torch.testing.assert_close(logits[40:], expected_b[:19], **close)
    torch.testing.assert_close(step[0], expected_a[40], **close)
    torch.testing.assert_close(step[1], expected_b[23], **close)


def test_fused_projections_are_views_and_the_model_is_unchanged() -> None:
    model = tiny_model("llama")
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    ids = torch.arange(3, 30)[None]
    with torch.inference_mode():
        expected = model(input_ids=ids).logits
        fuse_elementwise(model)
        decoder = llama_decoder(model)
        assert decoder is not None and llama_decoder(model) is decoder  # made once
        after = model.state_dict()
        assert list(after) == list(before)
        assert all(torch.equal(after[name], before[name]) for name in before)
        layer, attention = decoder.layers[0], model.model.layers[0].self_attn
        fused = layer.qkv_proj.weight
        assert attention.q_proj.weight.data_ptr() == fused.data_ptr()
        assert attention.k_proj.weight.untyped_storage().data_ptr() == (
            fused.untyped_storage().data_ptr()
        )
        torch.testing.assert_close(model(input_ids=ids).logits, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("architecture", ["qwen2", "mistral"])
def test_other_architectures_keep_transformers_forward(architecture: str) -> None:
    model = tiny_model(architecture)
    fuse_elementwise(model)
    assert llama_decoder(model) is None


def test_a_llama_whose_norms_were_not_fused_keeps_transformers_forward() -> None:
    model = tiny_model("llama")
    assert not isinstance(model.model.norm, FusedRMSNorm)
    assert llama_decoder(model) is None


def test_the_own_forward_and_the_transformers_path_agree_in_one_runner() -> None:
    model = tiny_model("llama")
    pool = torch.zeros(model.config.num_hidden_layers, 2, 32, 16, 2, 16)
    runner = ModelRunner(model, pool, make_backend("cpu", torch.device("cpu"), 16))
    decoder = runner.decoder
    assert decoder is not None
    chunks = [
        Chunk("a", list(range(3, 60)), 0, [0, 1, 2, 3], 57, True, all_logits=True),
        Chunk("b", list(range(200, 205)), 0, [4], 5, True),
    ]
    with torch.inference_mode():
        own = runner.run(chunks)
        runner.decoder = None  # the same step through transformers' modules, same KV slots
        theirs = runner.run(chunks)
    assert own.shape == theirs.shape == (58, 512)
    torch.testing.assert_close(own, theirs, atol=1e-5, rtol=1e-5)
