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


class ExceedsCacheQuota(InvalidRequest):
    """The request needs more KV cache than its budget or the pool can ever give it.

    Retrying cannot help; `needed_tokens` and `quota_tokens` are whole blocks, in tokens.
    """

    def __init__(self, message: str, needed_tokens: int, quota_tokens: int, param: str) -> None:
        super().__init__(message, param=param)
        self.needed_tokens = needed_tokens
        self.quota_tokens = quota_tokens


class RequestFailed(EngineError):
    """This request alone failed inside a step; the other requests in the step went on.

    Its input made the model raise, its logits or probabilities were not finite, or handling
    its output raised.
    """


class CacheQuotaTimeout(EngineError):
    """The tenant's cache quota stayed full for longer than the queue timeout."""


class PoolTimeout(EngineError):
    """The KV pool stayed full for longer than the queue timeout."""


class EngineOverloaded(EngineError):
    """The waiting queue is full."""


class TenantDeleted(EngineError):
    """The request's tenant was deleted while the request was in flight (or queued): never
    served, and nothing of it stays cached."""


class EngineRestarted(EngineError):
    """The engine failed outside any one request and restarted; retrying will be served."""


class EngineStopped(EngineError):
    """The engine is shutting down or has stopped."""
