"""What deploy/smoke.sh checks through each gateway of the running stack, with the real
`openai` client: a chat, a stream, a second turn that reuses the first one's cached tokens,
another user of the tenant and the second tenant with the same prompt, who both get the
public system prompt's blocks and nothing more, and the console's login page.

    python deploy/smoke/check.py --gateway URL [--gateway URL ...] --key TENANT=KEY ...
    python deploy/smoke/check.py --system-prompt   # the text smoke.sh registers as public

Prints one JSON object (the checks, their timings, and `held`); exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import httpx
import openai

MODEL = "smollm2-135m-instruct"
# Registered as a public prefix by smoke.sh: long enough for the policy's four whole blocks.
SYSTEM = (
    "You are the help desk of a small bicycle shop in the old town. Answer in one short "
    "sentence, politely, and never promise a repair date. The shop opens at nine and closes at "
    "six, Monday to Saturday, and is closed on public holidays. It sells city bikes, road bikes, "
    "children's bikes and spare parts, and it repairs all of them, whoever sold them; a repair "
    "is quoted before any work starts, and the quote is free of charge."
)
# Long enough for whole blocks of its own after the system prompt's: the private part.
QUESTION = (
    "Good morning. My road bike's rear derailleur skips gears on every climb, and the chain "
    "squeaks even after I cleaned and oiled it last weekend. Do you repair road bikes?"
)


def timed(checks: list[dict[str, Any]], name: str, check: Callable[[], str]) -> None:
    """Run one check; record whether it held, what it saw and how long it took."""
    started = time.perf_counter()
    try:
        seen, held = check(), True
    except Exception as error:  # a failed check is reported, and the others still run
        seen, held = f"{type(error).__name__}: {error}", False
    elapsed = round(time.perf_counter() - started, 2)
    checks.append({"check": name, "held": held, "seen": seen, "seconds": elapsed})


def cached_tokens(answer: Any) -> int:
    details = answer.usage.prompt_tokens_details
    return int(details.cached_tokens or 0) if details else 0


def check_gateway(url: str, keys: dict[str, str], user: str) -> list[dict[str, Any]]:
    (first_tenant, first_key), (second_tenant, second_key) = list(keys.items())[:2]
    first = openai.OpenAI(base_url=f"{url}/v1", api_key=first_key, max_retries=0, timeout=120)
    second = openai.OpenAI(base_url=f"{url}/v1", api_key=second_key, max_retries=0, timeout=120)
    opening = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    checks: list[dict[str, Any]] = []
    answers: dict[str, Any] = {}

    def ask(client: openai.OpenAI, messages: list[dict[str, str]], asker: str, tokens: int) -> Any:
        """One greedy chat completion of `messages` for `asker`, not streamed."""
        return client.chat.completions.create(
            model=MODEL,
            messages=messages,  # type: ignore[arg-type]
            user=asker,
            max_tokens=tokens,
            temperature=0,
        )

    def chat() -> str:
        answer = ask(first, opening, user, 24)
        answers["first"] = answer
        text = answer.choices[0].message.content or ""
        assert text.strip(), "an empty answer"
        return f"{answer.usage.prompt_tokens} prompt tokens; {text[:60]!r}"

    def stream() -> str:
        chunks = list(
            first.chat.completions.create(
                model=MODEL,
                messages=opening,
                user=f"{user}-stream",
                max_tokens=16,  # type: ignore[arg-type]
                temperature=0,
                stream=True,
            )
        )
        roles = [c.choices[0].delta.role for c in chunks if c.choices and c.choices[0].delta.role]
        finish = [
            c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
        ]
        assert roles[:1] == ["assistant"] and finish, f"roles {roles}, finish {finish}"
        return f"{len(chunks)} chunks, finish {finish[-1]}"

    def second_turn() -> str:
        reply = answers["first"].choices[0].message.content or ""
        messages = [*opening, {"role": "assistant", "content": reply},
                    {"role": "user", "content": "And city bikes?"}]  # fmt: skip
        answer = ask(first, messages, user, 16)
        answers["second"] = answer
        cached = cached_tokens(answer)
        assert cached > 0, f"no cached tokens of {answer.usage.prompt_tokens}"
        return f"{cached} of {answer.usage.prompt_tokens} prompt tokens cached"

    def public_only(client: openai.OpenAI, who: str, asker: str) -> str:
        """The opening again, from someone who may read the public system prompt's blocks
        but not the first user's: some cached tokens, fewer than the first user's turn."""
        answer = ask(client, opening, asker, 8)
        cached, own = cached_tokens(answer), cached_tokens(answers["second"])
        assert 0 < cached < own, f"{who}: {cached} cached tokens, the first user's turn {own}"
        answers[who] = answer
        return f"{who}: {cached} of {answer.usage.prompt_tokens} prompt tokens cached (public)"

    def other_user() -> str:
        return public_only(first, f"{first_tenant}'s other user", f"{user}-other")

    def other_tenant() -> str:
        seen = public_only(second, second_tenant, user)
        # Exactly the public blocks: what the first tenant's other user got, no more.
        cached, public = (
            cached_tokens(answers[second_tenant]),
            cached_tokens(answers[f"{first_tenant}'s other user"]),
        )
        assert cached == public, f"{second_tenant} got {cached} cached tokens, public {public}"
        return seen

    def console() -> str:
        page = httpx.get(f"{url}/admin/login", timeout=30)
        assert page.status_code == 200 and "<form" in page.text, page.status_code
        style = httpx.get(f"{url}/admin/static/console.css", timeout=30)
        assert style.status_code == 200 and style.text.strip(), style.status_code
        return "login page and its style sheet"

    steps = [
        ("chat", chat),
        ("stream", stream),
        ("second turn", second_turn),
        ("other user", other_user),
        ("other tenant", other_tenant),
        ("console", console),
    ]
    for name, check in steps:
        timed(checks, name, check)
    return checks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gateway", action="append", help="a gateway's URL")
    parser.add_argument("--key", action="append", help="TENANT=KEY, twice")
    parser.add_argument("--system-prompt", action="store_true", help="print it and exit")
    args = parser.parse_args(argv)
    if args.system_prompt:
        print(SYSTEM, end="")
        return 0
    if not args.gateway:
        parser.error("--gateway: at least one")
    keys = dict(item.split("=", 1) for item in args.key or [])
    if len(keys) < 2:
        parser.error("--key: two tenants' keys")
    result = {
        url: check_gateway(url, keys, f"smoke-user-{index}")
        for index, url in enumerate(args.gateway, 1)
    }
    held = all(check["held"] for checks in result.values() for check in checks)
    print(json.dumps({"gateways": result, "held": held}, indent=2))
    return 0 if held else 1


if __name__ == "__main__":
    sys.exit(main())
