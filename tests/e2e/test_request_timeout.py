"""`request_timeout_s` bounds the whole request, from its arrival, not from its first token:
a request whose body took most of the budget to arrive, and whose answer would go on for far
longer, ends at the deadline all the same (streamed: an error event coded `timeout`, then the
end; not streamed: a 504). A deadline restarted at the first token would let it run a whole
timeout more."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.local_server import tiny_chat_model
from tenancy.tenants import TenantLimits
from tests.support.gateway import MODEL, Gateway, start_gateway
from tests.support.raw_http import read_to_close

TIMEOUT_S = 3.0
UPLOAD_S = 2.0  # the body's second half comes this long after its first: the budget shrinks


@pytest.fixture(scope="module")
def hurried(
    migrated_template: str, smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    # A model whose 2,000 tokens take seconds on any CPU (each step reads its 38 M weights),
    # so that the answer outlasts the second left to it: the session's tiny model decoded
    # 1,500 tokens within that second on a fast machine and ended before the deadline.
    directory = tmp_path_factory.mktemp("models") / MODEL
    slow = tiny_chat_model(
        directory, smollm2_dir, hidden_size=384, intermediate_size=1536, num_hidden_layers=8
    )
    state_dir = tmp_path_factory.mktemp("timeout-state")
    tenants = [("acme", "user", TenantLimits())]
    with start_gateway(migrated_template, slow, state_dir, tenants,
                       request_timeout_s=TIMEOUT_S) as started:  # fmt: skip
        yield started


def slow_request(gateway: Gateway, stream: bool) -> tuple[bytes, float]:
    """A long answer asked for with a body sent in two halves `UPLOAD_S` apart: the response,
    and how long after the request's first byte the server closed the connection."""
    body = json.dumps({
        "model": MODEL, "messages": [{"role": "user", "content": "Count for ever."}],
        "max_tokens": 2000, "stream": stream,
    }).encode()  # fmt: skip
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nConnection: close\r\n"
        f"Authorization: Bearer {gateway.keys['acme']}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", gateway.server.port), timeout=60) as sock:
        began = time.monotonic()
        sock.sendall(head + body[:10])
        time.sleep(UPLOAD_S)
        sock.sendall(body[10:])
        response = read_to_close(sock)
        return response, time.monotonic() - began


def test_a_stream_that_keeps_producing_tokens_ends_at_the_deadline(hurried: Gateway) -> None:
    response, elapsed = slow_request(hurried, stream=True)
    assert response.startswith(b"HTTP/1.1 200"), response[:200]
    events = [line[6:] for line in response.split(b"\n") if line.startswith(b"data: ")]
    assert b"[DONE]" not in events
    *tokens, last = [json.loads(event) for event in events]
    assert any(chunk["choices"][0]["delta"].get("content") for chunk in tokens)
    assert last["error"]["code"] == "timeout" and last["error"]["type"] == "server_error"
    # From its arrival: a deadline restarted at the first token ends after UPLOAD_S + TIMEOUT_S.
    assert elapsed < UPLOAD_S + TIMEOUT_S - 0.5


def test_an_answer_that_is_not_streamed_is_a_504_at_the_deadline(hurried: Gateway) -> None:
    before = hurried.last_audit_seq()
    response, elapsed = slow_request(hurried, stream=False)
    head, _, body = response.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 504"), response[:300]
    assert json.loads(body)["error"]["code"] == "timeout"
    assert elapsed < UPLOAD_S + TIMEOUT_S - 0.5
    (event,) = hurried.wait_for_audit_events(before, 1)
    assert (event.outcome, event.details["status"], event.details["error"]) == (
        "failure", 504, "timeout",
    )  # fmt: skip
