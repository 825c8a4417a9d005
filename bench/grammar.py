"""Grammar libraries for structured outputs, measured on this CPU: xgrammar against llguidance.

    python -m bench.grammar [--json] [--out F]

For a few JSON schemas over the embedded model's tokenizer (SmolLM2, 49,152 tokens): the time
to set a library up for the vocabulary, to compile each schema, and to compute the next-token
mask at each token of a valid document (teacher-forced), median and worst.
engine/structured/grammar.py uses the one this chose and says why.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import llguidance
import llguidance.hf
import llguidance.torch
import xgrammar as xgr
from transformers import AutoTokenizer

from bench.common import emit, machine
from engine.model.loader import embedded_model_dir
from engine.structured.grammar import COMPACT

SCHEMAS: dict[str, tuple[dict[str, Any], Any]] = {
    "person": (
        {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
         "tags": {"type": "array", "items": {"type": "string"}}},
         "required": ["name", "age", "tags"], "additionalProperties": False},
        {"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry", "engines"]},
    ),
    "order": (
        {"type": "object", "properties": {
            "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
            "items": {"type": "array", "items": {"type": "object", "properties": {
                "sku": {"type": "string"}, "quantity": {"type": "integer", "minimum": 1}},
                "required": ["sku", "quantity"], "additionalProperties": False}},
            "express": {"type": "boolean"}, "status": {"enum": ["new", "paid", "sent"]}},
         "required": ["id", "items", "express", "status"], "additionalProperties": False},
        {"id": "ABC-1234", "items": [{"sku": "apple", "quantity": 3},
         {"sku": "pear", "quantity": 12}], "express": True, "status": "paid"},
    ),
}  # fmt: skip


def timed(call: Callable[[], object]) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def summary(seconds: list[float]) -> dict[str, float]:
    return {"median_us": statistics.median(seconds) * 1e6, "max_us": max(seconds) * 1e6}


def bench_xgrammar(tokenizer: Any, vocab: int, tokens: dict[str, list[int]]) -> dict[str, Any]:
    holder: dict[str, Any] = {}

    def setup() -> None:
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
        holder["compiler"] = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    result: dict[str, Any] = {"setup_ms": timed(setup) * 1e3}
    for name, (schema, _) in SCHEMAS.items():
        text = json.dumps(schema)

        def build(text: str = text) -> None:
            holder["grammar"] = holder["compiler"].compile_json_schema(
                text, any_whitespace=False, separators=COMPACT
            )

        compile_s = timed(build)
        matcher = xgr.GrammarMatcher(holder["grammar"])
        bitmask = xgr.allocate_token_bitmask(1, vocab)
        masks = []
        for token in tokens[name]:
            masks.append(timed(partial(matcher.fill_next_token_bitmask, bitmask)))
            assert matcher.accept_token(token), (name, token)
        result[name] = {"compile_ms": compile_s * 1e3, "mask": summary(masks)}
    return result


def bench_llguidance(tokenizer: Any, vocab: int, tokens: dict[str, list[int]]) -> dict[str, Any]:
    holder: dict[str, Any] = {}

    def setup() -> None:
        holder["tokenizer"] = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)

    result: dict[str, Any] = {"setup_ms": timed(setup) * 1e3}
    for name, (schema, _) in SCHEMAS.items():

        def build(schema: dict[str, Any] = schema) -> None:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
            holder["matcher"] = llguidance.LLMatcher(holder["tokenizer"], grammar)

        compile_s = timed(build)
        matcher = holder["matcher"]
        bitmask = llguidance.torch.allocate_token_bitmask(1, vocab)
        masks = []
        for token in tokens[name]:
            fill = partial(llguidance.torch.fill_next_token_bitmask, matcher, bitmask, 0)
            masks.append(timed(fill))
            assert matcher.consume_token(token), (name, token, matcher.get_error())
        result[name] = {"compile_ms": compile_s * 1e3, "mask": summary(masks)}
    return result


def run() -> dict[str, Any]:
    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir(), local_files_only=True)
    vocab = len(tokenizer)
    tokens = {
        name: tokenizer.encode(json.dumps(document, separators=(",", ":")),
                               add_special_tokens=False)
        for name, (_, document) in SCHEMAS.items()
    }  # fmt: skip
    return {
        "benchmark": "grammar",
        "vocabulary": vocab,
        "document_tokens": {name: len(ids) for name, ids in tokens.items()},
        "xgrammar": bench_xgrammar(tokenizer, vocab, tokens),
        "llguidance": bench_llguidance(tokenizer, vocab, tokens),
        "machine": machine(),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--out", help="also write the JSON result to this file")
    args = parser.parse_args(argv)
    result = run()
    emit(result, args.json, args.out)
    return result


if __name__ == "__main__":
    main()
