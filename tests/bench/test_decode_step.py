"""`bench.decode_step` on a tiny model: step times at 1 and N streams, and a step's shares."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from bench.decode_step import StepWork, main, share_of, step_work
from bench.machine_speed import Speed
from bench.prefix import TINY_VOCAB, tiny_llama


def test_a_step_splits_into_attention_linear_layers_and_the_rest() -> None:
    # 8 x 512 own tokens take two steps' budgets to prefill, so the first four streams decode
    # a step before the others: each measured step must still be one of all eight (checked).
    arguments = "--tiny --prefix-tokens 64 --unique-tokens 512 --streams 8 --steps 4 --rounds 1"
    result = main([*arguments.split(), "--json"])
    assert result["streams"] == 8 and result["attention_backend"] == "cpu"
    one, eight = result["step_ms"]["1"], result["step_ms"]["8"]
    assert result["scaling"] == pytest.approx(8 * one / eight)
    for count in ("1", "8"):
        shares = result["shares_ms"][count]
        # The kernels' ops are found, and they take less than the whole step.
        assert shares["attention"] > 0 and shares["linear"] > 0
        assert shares["attention"] + shares["linear"] < shares["step"]
    floor = result["floor"]
    assert floor["rates"]["matmul_tflops"][1] > 0 and floor["rates"]["read_gb_s"][1] > 0
    assert floor["8"]["flops"] == pytest.approx(8 * floor["1"]["flops"])
    assert floor["8"]["bytes"] > floor["1"]["bytes"]
    assert {floor["1"]["bound"], floor["8"]["bound"]} <= {"compute", "memory"}
    assert floor["scaling"] == pytest.approx(8 * floor["1"]["ms"] / floor["8"]["ms"])


def test_a_steps_work_counts_every_weight_read_whole_and_each_streams_attention() -> None:
    model = tiny_llama(64).model  # fp32, its LM head apart from its embedding
    per_layer = 256 * 256 + 2 * 256 * 128 + 256 * 256 + 3 * 256 * 688  # q, k and v, o, MLP
    weights = 4 * per_layer + TINY_VOCAB * 256  # the LM head's, not the embedding's
    attention = 2 * 2 * 4 * 4 * 64 * (10 + 6)  # q.k and p.v: layers x heads x dim x context
    kv_per_token = 4 * 2 * 2 * 64 * 4  # layers x (K, V) x KV heads x dim x 4 bytes
    work = step_work(model, prefix_tokens=10, unique_tokens=6, streams=3)
    assert work.flops == 3 * (2 * weights + attention)
    assert work.nbytes == weights * 4 + kv_per_token * (10 + 3 * 6)  # the prefix read once
    config = LlamaConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, tie_word_embeddings=True,
    )  # fmt: skip
    tied = LlamaForCausalLM(config)  # fp32
    one_layer = 32 * 32 * 4 + 3 * 32 * 64
    kv_bytes = 1 * 2 * (2 * 16) * 4  # one layer, K and V, 2 KV heads of 16, one token
    assert step_work(tied, 0, 1, 1).nbytes == 4 * (one_layer + 100 * 32) + kv_bytes


def test_the_floor_is_the_longer_of_the_arithmetic_and_the_reading() -> None:
    work = StepWork(flops=2e12, nbytes=1e9)
    # The read rate bounds the bytes; the in-place pass's rate (moved reads and writes) does not.
    fast_reads = Speed(matmul_tflops=1.0, memory_gb_s=0.01, read_gb_s=100.0)
    assert work.floor_ms(fast_reads) == (2000.0, "compute")
    slow_reads = Speed(matmul_tflops=10.0, memory_gb_s=100.0, read_gb_s=0.5)
    assert work.floor_ms(slow_reads) == (2000.0, "memory")


@pytest.mark.parametrize(
    "arguments", ["--streams 1", "--steps 0", "--rounds x", "--unique-tokens 0"]
)
def test_a_bad_argument_is_one_line_and_exit_2(
    arguments: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit:
        main(arguments.split())
    assert exit.value.code == 2
    last_line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "error: argument --" in last_line


def test_ops_are_counted_where_they_belong() -> None:
    assert share_of("prefixgate::paged_attention") == "attention"
    assert share_of("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention"
    assert share_of("prefixgate::matrix_linear") == "linear"
    assert share_of("aten::addmm") == "linear"
    assert share_of("aten::bmm") == "linear"
    assert share_of("aten::linear") == "linear"
    assert share_of("prefixgate::add_rms_norm_") == "rest"
    assert share_of("aten::index") == "rest"
