"""What deploy/smoke.sh checks through each gateway of the running stack, with the real
`openai` client: a chat, a stream, a second turn that reuses the first one's cached tokens,
the second tenant's identical prompt with no cached tokens, and the console's login page.

    python deploy/smoke/check.py --gateway URL [--gateway URL ...] --key TENANT=KEY ...

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
# Long enough to fill whole KV blocks, so that a second turn has cached blocks to reuse.
SYSTEM = (
    "You are the help desk of a small bicycle shop. Answer in one short sentence, politely, "
    "and never promise a repair date. The shop opens at nine and closes at six, Monday to "
    "Saturday; it sells city bikes, road bikes and spare parts, and repairs all of them."
)
QUESTION = "Do you repair road bikes?"


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

    def chat() -> str:
        answer = first.chat.completions.create(
            model=MODEL,
            messages=opening,
            user=user,
            max_tokens=24,
            temperature=0,  # type: ignore[arg-type]
        )
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
        answer = first.chat.completions.create(
            model=MODEL,
            messages=messages,
            user=user,
            max_tokens=16,
            temperature=0,  # type: ignore[arg-type]
        )
        cached = cached_tokens(answer)
        assert cached > 0, f"no cached tokens of {answer.usage.prompt_tokens}"
        return f"{cached} of {answer.usage.prompt_tokens} prompt tokens cached"

    def other_tenant() -> str:
        answer = second.chat.completions.create(
            model=MODEL,
            messages=opening,
            user=user,
            max_tokens=8,
            temperature=0,  # type: ignore[arg-type]
        )
        cached = cached_tokens(answer)
        assert cached == 0, f"{second_tenant} got {cached} cached tokens of {first_tenant}'s"
        return f"{second_tenant}: 0 of {answer.usage.prompt_tokens} prompt tokens cached"

    def console() -> str:
        page = httpx.get(f"{url}/admin/login", timeout=30)
        assert page.status_code == 200 and "<form" in page.text, page.status_code
        style = httpx.get(f"{url}/admin/static/console.css", timeout=30)
        assert style.status_code == 200 and style.text.strip(), style.status_code
        return "login page and its style sheet"

    for name, check in [("chat", chat), ("stream", stream), ("second turn", second_turn),
                        ("other tenant", other_tenant), ("console", console)]:  # fmt: skip
        if name == "second turn" and "first" not in answers:
            checks.append({"check": name, "held": False, "seen": "no first turn", "seconds": 0})
            continue
        timed(checks, name, check)
    return checks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gateway", action="append", required=True, help="a gateway's URL")
    parser.add_argument("--key", action="append", required=True, help="TENANT=KEY, twice")
    args = parser.parse_args(argv)
    keys = dict(item.split("=", 1) for item in args.key)
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
