"""How long block keys take: ns per token over a 50k-token prompt.

    python -m bench.hashing [--tokens 50000] [--block-size 16] [--json] [--out F] [--plot F]

Measures the whole path a request pays: encoding the token ids once, then chaining one
BLAKE2b-256 per full block. Reports the median and the best of several runs.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

from bench.common import emit, machine, plot_bars
from engine.cache.block_hash import BlockHasher, encode_token_ids
from engine.cache.scope import Public, User

TARGET_NS_PER_TOKEN = 50.0


def measure(num_tokens: int, block_size: int, repeats: int) -> dict[str, float]:
    rng = random.Random(0)
    token_ids = [rng.randrange(150_000) for _ in range(num_tokens)]
    hasher = BlockHasher(block_size)
    root = hasher.root("bench-model", "", "bfloat16")
    num_blocks = num_tokens // block_size
    # A realistic plan: a public system prompt, then one user's private conversation.
    public_blocks = min(num_blocks, 4096 // block_size)
    scopes = [Public("default")] * public_blocks + [User("t", "u")] * (num_blocks - public_blocks)
    totals, encodes = [], []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        token_bytes = encode_token_ids(token_ids)
        encoded = time.perf_counter_ns()
        keys = hasher.chain(root, token_bytes, scopes)
        end = time.perf_counter_ns()
        assert len(keys) == num_blocks
        totals.append((end - start) / num_tokens)
        encodes.append((encoded - start) / num_tokens)
    return {
        "ns_per_token": statistics.median(totals),
        "ns_per_token_best": min(totals),
        "encode_ns_per_token": statistics.median(encodes),
        "ns_per_block": statistics.median(totals) * block_size,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=50_000)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=25)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--out", help="also write the JSON result to this file")
    parser.add_argument("--plot", help="draw ns/token by block size to this PNG file")
    args = parser.parse_args(argv)
    if args.tokens < args.block_size or args.block_size <= 0 or args.repeats <= 0:
        parser.error("need --tokens >= --block-size > 0 and --repeats > 0")

    result: dict[str, Any] = {
        "benchmark": "hashing",
        "tokens": args.tokens,
        "block_size": args.block_size,
        "hash": "blake2b-512 truncated to 256 bits",
        **measure(args.tokens, args.block_size, args.repeats),
        "target_ns_per_token": TARGET_NS_PER_TOKEN,
        "machine": machine(),
    }
    result["meets_target"] = result["ns_per_token"] <= TARGET_NS_PER_TOKEN
    if args.plot:
        sizes = [8, 16, 32, 64]
        values = [
            measure(args.tokens, size, max(3, args.repeats // 5))["ns_per_token"] for size in sizes
        ]
        result["ns_per_token_by_block_size"] = dict(zip(map(str, sizes), values, strict=True))
        plot_bars(
            args.plot, "Block-key hashing", [f"block {s}" for s in sizes], values, "ns / token"
        )
    emit(result, args.json, args.out)
    if not args.json:
        print(
            f"{result['ns_per_token']:.1f} ns/token (best {result['ns_per_token_best']:.1f}; "
            f"encoding {result['encode_ns_per_token']:.1f}) over {args.tokens:,} tokens, "
            f"block size {args.block_size}; target <= {TARGET_NS_PER_TOKEN:.0f}"
        )
    return result


if __name__ == "__main__":
    main()
