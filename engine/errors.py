"""Typed engine errors; the gateway maps each to one HTTP status in one place."""

from __future__ import annotations


class EngineError(Exception):
    """Base class: the message is safe to show a client."""


class InvalidRequest(EngineError):
    """The request itself is wrong; `param` names the field when there is one."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ContextTooLong(InvalidRequest):
    """Prompt plus max_tokens exceed what the model or the pool can hold."""

    def __init__(self, message: str) -> None:
        super().__init__(message, param="messages")


class CacheQuotaTimeout(EngineError):
    """The tenant's cache quota stayed full for longer than the queue timeout."""


class PoolTimeout(EngineError):
    """The KV pool stayed full for longer than the queue timeout."""


class EngineOverloaded(EngineError):
    """The waiting queue is full."""


class EngineStopped(EngineError):
    """The engine is shutting down or has stopped."""
