"""HTTP/1.1 by hand over a socket, for tests that must see what a connection does."""

from __future__ import annotations

import socket


def exchange(sock: socket.socket, request: bytes) -> bytes:
    """Send one keep-alive request and read its (Content-Length) response, head and body."""
    sock.sendall(request)
    response = b""
    while b"\r\n\r\n" not in response:
        response += sock.recv(65536)
    head, _, body = response.partition(b"\r\n\r\n")
    lines = head.lower().split(b"\r\n")
    length = int(next(line.split(b":")[1] for line in lines if line.startswith(b"content-length")))
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def read_to_close(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received
