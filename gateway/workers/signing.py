"""Gateways sign what they ask of workers; workers do only what a gateway signed, once.

The worker secret says "a gateway sent this"; it does not say *which cache* the request may
read. A holder of the secret alone could otherwise send any tenant's scope with a guessed
prompt and read the answer's cached tokens (a membership oracle for private prompts). So every
POST to a worker carries `X-PrefixGate-Signature: t=<unix time>;n=<nonce>;s=<hex>`: an
HMAC-SHA256 under the gateways' signing key (`worker_signing_key`) over the time it was signed,
a random nonce and a canonical encoding of what the worker will act on:

- a generation: the model's fingerprint (the worker checks against its own) and a SHA-256 of
  the whole request as it travels (tenant, segments and their scopes, tail scope, budget,
  weight, token ids, sampling, `n`, grammar): a one-token change to the prompt, another
  scope, more tokens, another grammar, or the same request sent to another model's worker no
  longer matches.
- an admin action (budgets, purge, drop-public-prefix): its name and its whole body.

A signature is good for `MAX_AGE_S` either side of the worker's clock, and once: a worker
remembers the signatures it accepted until they are too old anyway, so a recorded request
can be neither replayed nor, being signed whole, reshaped (gateways and workers need clocks
within a minute of each other; NTP keeps them within milliseconds).

The canonical encoding is JSON with sorted keys, no spaces, ASCII only and no NaN, over the
values as they travel: the gateway encodes the dict it sends, the worker the dict it parsed
from the same bytes, and JSON's numbers, strings and lists round-trip exactly in Python. It is
computed before anything is compiled or queued; the comparison is constant-time.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import threading
import time
from collections import OrderedDict
from typing import Any, Literal

SIGNATURE_HEADER = "X-PrefixGate-Signature"
_DOMAIN = b"prefixgate-worker-request-v2\x00"  # never the same bytes as any other use of a key

MAX_AGE_S = 60  # how far a signature's time may be from the worker's clock
NONCE_BYTES = 16

Json = dict[str, Any]
Refusal = Literal["missing", "mismatch", "stale", "replayed"]


def canonical(value: Any) -> bytes:
    """The one byte encoding both sides sign: sorted keys, no spaces, ASCII, no NaN."""
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    ).encode()


def generation_view(body: Json, fingerprint: str) -> Json:
    """What a generation request's signature covers (wire.request_json's dict): all of it,
    as a digest, and the model it is for."""
    return {
        "action": "generate",
        "model": fingerprint,
        "request": hashlib.sha256(canonical(body)).hexdigest(),
    }


def action_view(action: str, body: Json | None) -> Json:
    """What an admin action's signature covers: its name and its whole body."""
    return {"action": action, "body": body}


class RequestSigner:
    """Signs (gateway) and checks (worker) requests under the shared signing key; a checking
    side refuses a signature it has accepted before, or one signed too long ago."""

    def __init__(self, key: str) -> None:
        self._key = key.encode()
        # Accepted signatures, oldest first, until MAX_AGE_S after their time has passed.
        self._accepted: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()

    def sign(self, view: Json, now: float | None = None) -> str:
        """The signature header's value for `view`, signed at `now` (default: the clock)."""
        issued = int(time.time() if now is None else now)
        # A fresh nonce: two gateways sending the same action in the same second (a worker's
        # catch-up) make two signatures, neither a replay of the other.
        nonce = secrets.token_hex(NONCE_BYTES)
        return f"t={issued};n={nonce};s={self._mac(view, issued, nonce)}"

    def verify(self, view: Json, header: str | None, now: float | None = None) -> Refusal | None:
        """None if `header` signs `view`, within MAX_AGE_S of `now` and for the first time
        (it is then remembered); else why not. Constant-time against the expected MAC."""
        now = time.time() if now is None else now
        parsed = _parse(header)
        if parsed is None:
            return "missing"
        issued, nonce, mac = parsed
        try:
            expected = self._mac(view, issued, nonce)
        except (ValueError, TypeError):  # a view that cannot be encoded, such as one with NaN
            return "mismatch"
        if not hmac.compare_digest(expected.encode(), mac.encode("ascii", "replace")):
            return "mismatch"
        if abs(now - issued) > MAX_AGE_S:
            return "stale"
        with self._lock:
            while self._accepted and next(iter(self._accepted.values())) < now:
                self._accepted.popitem(last=False)
            if mac in self._accepted:
                return "replayed"
            self._accepted[mac] = issued + MAX_AGE_S
        return None

    def _mac(self, view: Json, issued: int, nonce: str) -> str:
        stamp = f"{issued}\x00{nonce}\x00".encode()
        message = _DOMAIN + stamp + canonical(view)
        return hmac.new(self._key, message, hashlib.sha256).hexdigest()


def _parse(header: str | None) -> tuple[int, str, str] | None:
    """(time, nonce, MAC) from `t=<unix time>;n=<hex>;s=<hex>`, else None."""
    fields = dict(part.partition("=")[::2] for part in (header or "").split(";"))
    issued, nonce, mac = fields.get("t", ""), fields.get("n", ""), fields.get("s", "")
    if not issued.isascii() or not issued.isdigit() or len(issued) > 12 or not mac:
        return None
    if len(nonce) != 2 * NONCE_BYTES or not all(c in "0123456789abcdef" for c in nonce):
        return None
    return int(issued), nonce, mac
