"""Typed errors of the tenancy layer; the CLI and the gateway map them to messages/statuses."""

from __future__ import annotations


class TenancyError(Exception):
    """Base class; the message is safe to show the operator or client."""


class NotFound(TenancyError):
    pass


class Conflict(TenancyError):
    pass


class InvalidInput(TenancyError):
    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field
