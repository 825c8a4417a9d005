"""n > 1 on shared KV: one request for n choices against n separate requests.

    python -m bench.choices [--n 8] [--prompt-tokens 1024] [--output-tokens 16]
        [--model DIR | --tiny] [--json] [--out F]

On one engine each (the embedded SmolLM2 by default; `--tiny` for a seeded tiny Llama), the
same prompt and sampling run as (a) one request with n choices, (b) n separate requests with
prefix caching off and (c) n separate requests with prefix caching on, all in one scope. For
each: the peak of KV blocks in use, the prompt positions the model computed (the engine's
scheduled tokens minus the fed-back output tokens), the completion tokens and the wall time.
(a) should compute the prompt once, like (b)'s single request, and hold its full blocks once.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import time
from pathlib import Path
from typing import Any

from bench.common import emit, machine
from bench.prefix import tiny_llama
from engine.cache.scope import User
from engine.config import EngineConfig
from engine.engine import Engine
from engine.model.loader import LoadedModel, load_model
from engine.request import GenerationDelta, GenerationRequest
from engine.sampling.sampler import SamplingParams
from engine.sequence import choice_request

BLOCK_SIZE = 16


def run(loaded: LoadedModel, requests: list[GenerationRequest], caching: bool) -> dict[str, Any]:
    """Run `requests` at once on a fresh engine; what they cost."""
    config = EngineConfig(block_size=BLOCK_SIZE, num_blocks=4096, enable_prefix_caching=caching)
    engine = Engine(loaded, config)
    finals: list[GenerationDelta] = []

    def sink(item: GenerationDelta | Exception) -> None:
        if isinstance(item, Exception):
            raise item
        if item.finish_reason is not None:
            finals.append(item)

    started = time.perf_counter()
    for request in requests:
        engine.submit(request, sink)
    while engine.step():
        pass
    seconds = time.perf_counter() - started
    completion = sum(delta.usage.completion_tokens for delta in finals if delta.usage)
    # Every output token but each choice's last is fed back as one scheduled token.
    fed_back = completion - len(finals)
    return {
        "choices": len(finals),
        "peak_blocks": engine.cache.peak_active_blocks,
        "prompt_positions_computed": engine.metrics.scheduled_tokens - fed_back,
        "completion_tokens": completion,
        "seconds": round(seconds, 3),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--model", type=Path, help="a model directory (default: embedded)")
    parser.add_argument("--tiny", action="store_true", help="a seeded tiny Llama instead")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args(argv)

    loaded = tiny_llama(4096) if args.tiny else load_model(args.model)
    rng = random.Random(0)
    prompt = [rng.randrange(1, loaded.vocab_size) for _ in range(args.prompt_tokens)]
    sampling = SamplingParams(
        max_tokens=args.output_tokens, temperature=1.0, seed=0, ignore_eos=True
    )
    scope = User("bench", "user")
    request = GenerationRequest("choices", "bench", prompt, sampling, tail_scope=scope)
    shared = dataclasses.replace(request, n=args.n)
    separate = [
        dataclasses.replace(choice_request(shared, index), n=1, request_id=f"separate-{index}")
        for index in range(args.n)
    ]
    run(loaded, [request], caching=False)  # warm-up: first-call costs stay out of the numbers
    result = {
        "benchmark": "choices",
        "machine": machine(),
        "model": loaded.name,
        "n": args.n,
        "prompt_tokens": args.prompt_tokens,
        "output_tokens": args.output_tokens,
        "block_size": BLOCK_SIZE,
        "one_request_n_choices": run(loaded, [shared], caching=True),
        "separate_requests_no_cache": run(loaded, separate, caching=False),
        "separate_requests_prefix_cache": run(loaded, separate, caching=True),
        "one_request_n_1": run(loaded, [request], caching=True),
    }
    emit(result, args.json, args.out)
    if not args.json:
        print(_table(result))
    return result


def _table(result: dict[str, Any]) -> str:
    rows = [
        f"{'':34} {'peak blocks':>12} {'prompt computed':>16} {'seconds':>8}",
    ]
    for name in (
        "one_request_n_choices",
        "separate_requests_no_cache",
        "separate_requests_prefix_cache",
        "one_request_n_1",
    ):
        entry = result[name]
        rows.append(
            f"{name:34} {entry['peak_blocks']:>12} {entry['prompt_positions_computed']:>16} "
            f"{entry['seconds']:>8}"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    main()
