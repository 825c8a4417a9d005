"""Log probabilities through the engine are the model's own: `log_softmax` of its logits for
each sampled token and its top k, before penalties or bias change the choice (fp32, 1e-4)."""

from __future__ import annotations

import dataclasses

import torch

from engine.request import GenerationDelta
from engine.sampling.sampler import SamplingParams, TokenLogprobs
from tests.support.models import engine_for, make_request, reference_copy, run_one, tiny_model


def reference_logprobs(prompt: list[int], tokens: list[int]) -> list[torch.Tensor]:
    """The model's log_softmax at each generated position, from its own full forward."""
    model = reference_copy(tiny_model("llama"))
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0].float()
    return [torch.log_softmax(logits[len(prompt) - 1 + i], -1) for i in range(len(tokens))]


def test_logprobs_are_log_softmax_of_the_models_logits_for_sampled_and_top_tokens() -> None:
    prompt = list(range(5, 30))
    # Sampled at temperature 1.3 with a bias and a penalty: the logprobs stay the model's.
    params = SamplingParams(
        max_tokens=8, temperature=1.3, seed=11, logprobs=4, ignore_eos=True,
        logit_bias=((17, 3.0),), presence_penalty=0.5,
    )  # fmt: skip
    served = run_one(engine_for("llama"), make_request("lp", prompt, sampling=params))
    deltas = [delta for delta in served.deltas if delta.token_ids]
    logprobs = [item for delta in deltas for item in (delta.logprobs or [])]
    assert [item.token for item in logprobs] == served.token_ids
    expected = reference_logprobs(prompt, served.token_ids)
    for item, row in zip(logprobs, expected, strict=True):
        assert abs(item.logprob - float(row[item.token])) < 1e-4
        top_values, top_ids = torch.topk(row, 4)
        assert [token for token, _ in item.top] == top_ids.tolist()
        torch.testing.assert_close(
            torch.tensor([value for _, value in item.top]), top_values, atol=1e-4, rtol=0
        )


def test_without_logprobs_deltas_carry_none_and_zero_top_gives_the_token_alone() -> None:
    prompt = list(range(40, 60))
    engine = engine_for("llama")
    plain = run_one(engine, make_request("a", prompt, max_tokens=3))
    assert all(delta.logprobs is None for delta in plain.deltas)
    sampling = SamplingParams(max_tokens=3, temperature=0.0, logprobs=0)
    alone = run_one(engine, make_request("b", prompt, sampling=sampling))
    items = [item for delta in alone.deltas for item in (delta.logprobs or [])]
    assert len(items) == 3 and all(item.top == () for item in items)
    assert alone.token_ids == plain.token_ids  # asking for logprobs changes no choice


def prompt_reference(prompt: list[int]) -> torch.Tensor:
    """log_softmax at every prompt position, from the model's own full forward."""
    model = reference_copy(tiny_model("llama"))
    with torch.inference_mode():
        return torch.log_softmax(model(input_ids=torch.tensor([prompt])).logits[0].float(), -1)


def check_prompt_logprobs(items: list[TokenLogprobs], prompt: list[int], k: int) -> None:
    expected = prompt_reference(prompt)
    assert [item.token for item in items] == prompt[1:]
    for position, item in enumerate(items):
        row = expected[position]
        assert abs(item.logprob - float(row[item.token])) < 1e-4, f"position {position}"
        assert [token for token, _ in item.top] == torch.topk(row, k).indices.tolist()


def test_prompt_logprobs_score_every_prompt_token_even_one_cached_and_chunked() -> None:
    # 600 tokens: three chunks of at most 256 logits rows each, and a prefix already cached.
    prompt = [(11 * position + 5) % 500 + 1 for position in range(600)]
    engine = engine_for("llama", num_blocks=512)
    warm = run_one(engine, make_request("warm", prompt, max_tokens=1))
    assert warm.usage.completion_tokens == 1
    request = dataclasses.replace(make_request("score", prompt, max_tokens=2), prompt_logprobs=3)
    served = run_one(engine, request)
    firsts = [delta for delta in served.deltas if delta.prompt_logprobs is not None]
    assert len(firsts) == 1 and firsts[0] is served.deltas[0]
    check_prompt_logprobs(firsts[0].prompt_logprobs or [], prompt, 3)
    # Every position was computed: no cached block was used for the scored prompt.
    assert served.usage.cached_tokens == 0
    # The output is what the request gives without prompt logprobs.
    plain = run_one(engine, make_request("plain", prompt, max_tokens=2))
    assert served.token_ids == plain.token_ids


def test_every_choice_carries_the_prompt_logprobs() -> None:
    prompt = list(range(3, 43))
    engine = engine_for("llama")
    request = dataclasses.replace(make_request("n", prompt, max_tokens=3), prompt_logprobs=0, n=2)
    deltas: list[GenerationDelta] = []
    engine.submit(request, deltas.append)  # type: ignore[arg-type]
    while engine.step():
        pass
    firsts = {d.index: d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None}
    assert set(firsts) == {0, 1}
    for items in firsts.values():
        check_prompt_logprobs(items, prompt, 0)
