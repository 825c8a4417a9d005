"""Gateways sign what they ask of workers; workers do only what a gateway signed.

The worker secret says "a gateway sent this"; it does not say *which cache* the request may
read. A holder of the secret alone could otherwise send any tenant's scope with a guessed
prompt and read the answer's cached tokens (a membership oracle for private prompts). So every
POST to a worker carries `X-PrefixGate-Signature`: an HMAC-SHA256 under the gateways' signing
key (`worker_signing_key`) over a canonical encoding of what the worker will act on:

- a generation: the model's fingerprint (the worker checks against its own), the request id,
  the tenant, every segment with its scope, the tail scope, the budget and scheduling weight,
  and a SHA-256 digest of the prompt's token ids. A one-token change to the prompt, another
  scope, another tenant's budget, or the same request sent to another model's worker no
  longer matches.
- an admin action (budgets, purge, drop-public-prefix, drain): its name and its whole body.

The canonical encoding is JSON with sorted keys, no spaces, ASCII only and no NaN, over the
values as they travel: the gateway encodes the dict it sends, the worker the dict it parsed
from the same bytes, and JSON's numbers, strings and lists round-trip exactly in Python. It is
computed before anything is compiled or queued; the comparison is constant-time.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any

SIGNATURE_HEADER = "X-PrefixGate-Signature"
_DOMAIN = b"prefixgate-worker-request-v1\x00"  # never the same bytes as any other use of a key

Json = dict[str, Any]


def canonical(value: Any) -> bytes:
    """The one byte encoding both sides sign: sorted keys, no spaces, ASCII, no NaN."""
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    ).encode()


def generation_view(body: Json, fingerprint: str) -> Json:
    """What of a generation request (wire.request_json's dict) a signature covers: everything
    that decides which cached blocks it may read or fill, and whose quota pays."""
    return {
        "action": "generate",
        "model": fingerprint,
        "request_id": body.get("request_id"),
        "tenant_id": body.get("tenant_id"),
        "segments": body.get("segments"),
        "tail_scope": body.get("tail_scope"),
        "budget": body.get("budget"),
        "weight": body.get("weight"),
        "prompt_token_ids": hashlib.sha256(canonical(body.get("prompt_token_ids"))).hexdigest(),
    }


def action_view(action: str, body: Json | None) -> Json:
    """What an admin action's signature covers: its name and its whole body."""
    return {"action": action, "body": body}


class RequestSigner:
    """Signs (gateway) and checks (worker) requests under the shared signing key."""

    def __init__(self, key: str) -> None:
        self._key = key.encode()

    def sign(self, view: Json) -> str:
        return hmac.new(self._key, _DOMAIN + canonical(view), hashlib.sha256).hexdigest()

    def verify(self, view: Json, signature: str | None) -> bool:
        """Whether `signature` is this key's over `view` (constant-time; False for a view that
        cannot be encoded, such as one with NaN)."""
        if not signature:
            return False
        try:
            expected = self.sign(view)
        except (ValueError, TypeError):
            return False
        return hmac.compare_digest(expected.encode(), signature.encode("ascii", "replace"))
