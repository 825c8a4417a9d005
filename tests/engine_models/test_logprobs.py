"""Log probabilities through the engine are the model's own: `log_softmax` of its logits for
each sampled token and its top k, before penalties or bias change the choice (fp32, 1e-4)."""

from __future__ import annotations

import torch

from engine.sampler import SamplingParams
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
