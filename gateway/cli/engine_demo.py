"""The engine's demo: three users of two tenants (alice and bob of acme, carol of globex)
chatting with the embedded model through the prefix cache.

A shared system prompt is scoped public, everything else private to the user, the way the
policy module will scope them. The demo shows which prompt tokens each request reused, what
that did to its time to first token, and how much each owner of cached blocks was reused.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from engine.cache.budget import PUBLIC_OWNER, describe_owner
from engine.cache.scope import Public, Segment, User
from engine.cache.stats import CacheStats
from engine.config import EngineConfig
from engine.engine import Engine
from engine.model.loader import LoadedModel
from engine.request import GenerationRequest
from engine.sampling.sampler import SamplingParams

SYSTEM_PROMPT = (
    "You are a concise assistant for a travel agency. Answer in one short sentence. "
    "Prefer facts about European cities: their capitals, rivers, landmarks and museums. "
    "If you do not know, say so plainly."
)


@dataclass(frozen=True, slots=True)
class DemoTurn:
    tenant_id: str
    user_id: str
    question: str
    answer: str
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float


def render(tokenizer: Any, messages: list[dict[str, str]], generation_prompt: bool) -> list[int]:
    rendered = tokenizer.apply_chat_template(
        messages, add_generation_prompt=generation_prompt, tokenize=True
    )
    return list(rendered["input_ids"])


def segments_for(tokenizer: Any, token_ids: list[int], tenant: str, user: str) -> list[Segment]:
    """The rendered system message public, the rest private to the user."""
    system = render(tokenizer, [{"role": "system", "content": SYSTEM_PROMPT}], False)
    private = User(tenant, user)
    if token_ids[: len(system)] != system:
        return [Segment(0, len(token_ids), private)]
    return [Segment(0, len(system), Public("demo")), Segment(len(system), len(token_ids), private)]


def script() -> Iterator[tuple[str, str, list[str]]]:
    yield "acme", "alice", ["What is the capital of France?", "Which river flows through it?"]
    yield "acme", "bob", ["What is the capital of Italy?"]
    yield "globex", "carol", ["What is the capital of France?"]


def run_demo(
    loaded: LoadedModel, attention_backend: str = "auto"
) -> tuple[list[DemoTurn], CacheStats]:
    """Serve the scripted conversations one turn at a time; returns the turns and the cache."""
    tokenizer = loaded.tokenizer
    config = EngineConfig(num_blocks=512, max_num_seqs=4, attention_backend=attention_backend)
    engine = Engine(loaded, config).start()
    turns: list[DemoTurn] = []
    for tenant, user, questions in script():
        messages = [{"role": "system", "content": SYSTEM_PROMPT}]
        for question in questions:
            messages.append({"role": "user", "content": question})
            token_ids = render(tokenizer, messages, True)
            request = GenerationRequest(
                f"demo-{len(turns)}",
                tenant,
                token_ids,
                SamplingParams(max_tokens=48, temperature=0.0),
                segments_for(tokenizer, token_ids, tenant, user),
                User(tenant, user),
            )
            started = time.perf_counter()
            first_token = 0.0
            answer = ""
            for delta in engine.generate_sync(request):
                first_token = first_token or time.perf_counter() - started
                answer += delta.text
                usage = delta.usage
            assert usage is not None
            messages.append({"role": "assistant", "content": answer})
            turns.append(
                DemoTurn(
                    tenant_id=tenant,
                    user_id=user,
                    question=question,
                    answer=answer.strip(),
                    prompt_tokens=usage.prompt_tokens,
                    cached_tokens=usage.cached_tokens,
                    ttft_s=first_token,
                )
            )
    engine.stop()
    return turns, engine.cache_stats()


def reuse_lines(stats: CacheStats) -> list[str]:
    """One line per owner with cached blocks or prompts: its blocks and their reuse. A
    tenant's reuse is of all its prompt tokens; the public budget's, of the prompt tokens in
    public blocks (any tenant's), those read from its cached blocks."""
    lines = []
    for owner, owner_stats in sorted(stats.owners.items(), key=lambda item: str(item[0])):
        counters = owner_stats.counters
        if not (owner_stats.cached_blocks or counters.prompt_tokens):
            continue
        which = "prompt tokens in public blocks" if owner is PUBLIC_OWNER else "prompt tokens"
        lines.append(
            f"{describe_owner(owner)}: {owner_stats.cached_blocks} cached blocks, reuse "
            f"{counters.reuse:.0%} ({counters.cached_tokens} of {counters.prompt_tokens} {which})"
        )
    return lines
