"""Requests the HTTP parser refuses are answered in OpenAI's error shape (a JSON 400 coded
`invalid_http_request`, then the connection closes) wherever an answer can still be placed on
the connection, never with uvicorn's plain text; where it cannot (an earlier response on the
connection still being sent), the connection closes once that response is complete."""

from __future__ import annotations

import json
import socket

import pytest

from tests.support.gateway import Gateway
from tests.support.raw_http import read_to_close

MALFORMED = {
    "request line": b"GET /healthz HTTP/1.1 trailing\r\nHost: t\r\n\r\n",
    "method": b"G(T /healthz HTTP/1.1\r\nHost: t\r\n\r\n",
    "header name": b"GET /healthz HTTP/1.1\r\nHost: t\r\nBad Name: x\r\n\r\n",
    "header value": b"GET /healthz HTTP/1.1\r\nHost: t\r\nX-Note: a\x01b\r\n\r\n",
    "path": b"GET /\xffhealthz HTTP/1.1\r\nHost: t\r\n\r\n",
    "two lengths": b"POST /healthz HTTP/1.1\r\nHost: t\r\nContent-Length: 1\r\n"
    b"Content-Length: 2\r\n\r\nab",
    "length and chunks": b"POST /healthz HTTP/1.1\r\nHost: t\r\nContent-Length: 1\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n1\r\na\r\n0\r\n\r\n",
    "not HTTP at all": b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",
}


def exchange_to_close(gateway: Gateway, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", gateway.server.port), timeout=10) as sock:
        sock.sendall(data)
        return read_to_close(sock)


def split_responses(received: bytes) -> list[tuple[bytes, bytes]]:
    """(head, body) of each Content-Length response in `received`, in order."""
    responses = []
    while received:
        head, _, rest = received.partition(b"\r\n\r\n")
        lines = head.lower().split(b"\r\n")
        length = int(
            next(line.split(b":")[1] for line in lines if line.startswith(b"content-length"))
        )
        responses.append((head, rest[:length]))
        received = rest[length:]
    return responses


def assert_json_400(head: bytes, body: bytes) -> dict[str, object]:
    lines = head.lower().split(b"\r\n")
    assert lines[0] == b"http/1.1 400 bad request", head
    assert b"content-type: application/json" in lines, head
    assert b"connection: close" in lines, head
    error: dict[str, object] = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"], error["code"]) == (
        "invalid_request_error", None, "invalid_http_request",
    )  # fmt: skip
    return error


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_request_gets_a_json_400_and_the_connection_closes(
    gateway: Gateway, case: str
) -> None:
    ((head, body),) = split_responses(exchange_to_close(gateway, MALFORMED[case]))
    error = assert_json_400(head, body)
    assert str(error["message"]).startswith("the request is not valid HTTP/1.1")


def test_a_bad_chunk_in_a_body_being_read_is_a_json_400_and_audited(gateway: Gateway) -> None:
    before = gateway.last_audit_seq()
    request = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\n"
        f"Authorization: Bearer {gateway.keys['acme']}\r\nContent-Type: application/json\r\n"
        'Transfer-Encoding: chunked\r\n\r\n5\r\n{"mod\r\nzz\r\n'
    ).encode()
    ((head, body),) = split_responses(exchange_to_close(gateway, request))
    error = assert_json_400(head, body)
    assert "chunk" in str(error["message"]).lower()
    events = gateway.wait_for_audit_events(before, 1)
    assert [(event.action, event.outcome, event.details["status"]) for event in events] == [
        ("inference.chat", "rejected", 400)
    ]


def test_behind_a_pipelined_request_the_bad_one_waits_its_turn(gateway: Gateway) -> None:
    good = b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n"
    bad_chunk = b"POST /healthz HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"
    (first, first_body), (second, second_body) = split_responses(
        exchange_to_close(gateway, good + bad_chunk)
    )
    assert first.startswith(b"HTTP/1.1 200") and json.loads(first_body) == {"status": "ok"}
    assert_json_400(second, second_body)


def test_a_bad_head_behind_a_pipelined_request_closes_after_its_answer(
    gateway: Gateway,
) -> None:
    good = b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n"
    ((head, body),) = split_responses(exchange_to_close(gateway, good + MALFORMED["method"]))
    assert head.startswith(b"HTTP/1.1 200") and json.loads(body) == {"status": "ok"}
    assert b"connection: close" in head.lower().split(b"\r\n")
