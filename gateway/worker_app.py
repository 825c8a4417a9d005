"""`prefixgate worker`: one engine behind an internal HTTP API that only gateways call.

Only gateways reach a worker: it serves HTTPS and takes only clients whose certificate the
gateways' private CA signed (gateway/workers/tls.py; `prefixgate worker` sets that up).
Every route but /healthz and /readyz also needs `Authorization: Bearer <worker secret>`,
compared in constant time, and every POST but /drain a gateway's signature
(`X-PrefixGate-Signature`, gateway/workers/signing.py) over the scopes, tenant, budget, model
and prompt digest it acts on: a bad secret is a 401, a signature that does not match a 403,
both before anything is parsed further or queued. A worker holds no tenant state and never
touches the database: each request carries its tenant's budget, and a gateway pushes quota
changes, purges and dropped public prefixes to every worker.

- `POST /internal/v1/generate`: a request (gateway/workers/wire.py) in, newline-delimited JSON
  out, one `{"delta": ...}` per delta and at most one `{"error": ...}`. A request the engine
  refuses at once gets a non-200 status with `{"error": ...}`, before anything streams.
- `GET /internal/v1/state?epoch=E&since=S`: the model it serves (name and fingerprint), load,
  cache statistics, the cached keys that changed since S (as digests under a key derived from
  the signing key, so that they confirm no guessed prompt: gateway/workers/key_log.py), and
  its report: sequences per tenant with work, service per tenant served, recent step times
  (gateway/workers/activity.py; each bounded).
- `GET /internal/v1/model`: the served model's tokenizer and config files (no weights) and its
  chat template, so that a gateway can serve a model it has no files of
  (gateway/workers/models.py).
- `POST /internal/v1/budgets`, `/purge`, `/drop-public-prefix`: the engine's admin actions.
- `POST /internal/v1/drain`: take no new requests (503, so gateways route elsewhere); those
  in flight finish. Unsigned: it names no tenant and reveals nothing (SIGTERM does the same).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Any

import anyio
from fastapi import Depends, FastAPI, Header, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from engine import errors
from engine.engine import Engine
from engine.model.loader import LoadedModel, shape_files
from engine.model.openmp import on_passing_thread
from engine.sampling.sampler import InvalidSampling
from gateway.runtime.engine_setup import start_engine
from gateway.settings import Settings
from gateway.workers import wire
from gateway.workers.activity import activity_json
from gateway.workers.key_log import KeyDigest, KeyLog
from gateway.workers.link import SIGNING_KEY_MISSING
from gateway.workers.signing import (
    SIGNATURE_HEADER,
    Refusal,
    RequestSigner,
    action_view,
    generation_view,
)

logger = logging.getLogger(__name__)
_DISCONNECT_POLL_S = 0.1

# The HTTP status of an engine refusal made before anything streamed. 503 tells a gateway to
# try another worker; 4xx are the request's own fault and would fail anywhere.
_STATUS: dict[type[errors.EngineError], int] = {
    errors.InvalidRequest: 400,
    errors.CacheQuotaTimeout: 429,
    errors.PoolTimeout: 503,
    errors.EngineOverloaded: 503,
    errors.EngineRestarted: 503,
    errors.EngineStopped: 503,
    errors.RequestFailed: 500,
    # Not 403: a worker's 403 tells a gateway that it refused the gateway's signature.
    errors.TenantDeleted: 410,
}


_SIGNATURE_REFUSALS: dict[Refusal, str] = {
    "missing": "the request carries no gateway signature",
    "mismatch": "the request's signature does not match what it asks for",
    "stale": "the request's signature is too old or from the future (check both clocks)",
    "replayed": "the request's signature was used before",
}


def status_of(error: errors.EngineError) -> int:
    for kind, status in _STATUS.items():
        if isinstance(error, kind):
            return status
    return 500


class WorkerState:
    """The engine, the name it is served under, its key log, and whether the worker still
    takes requests."""

    def __init__(self, engine: Engine, model_name: str, digest: KeyDigest) -> None:
        self.engine = engine
        self.model_name = model_name
        self.keys = KeyLog(engine.cached_keys, digest)
        self.draining = False


def create_worker_app(
    settings: Settings,
    loaded: LoadedModel | None = None,
    announce: Callable[[str], None] = print,
) -> FastAPI:
    """The worker app; the model loads and the engine starts in its lifespan, which says
    (`announce`) which model it serves, under which name."""
    if settings.worker_secret is None:
        raise ValueError("a worker needs PREFIXGATE_WORKER_SECRET (the gateways' shared secret)")
    if settings.worker_signing_key is None:
        raise ValueError(SIGNING_KEY_MISSING)
    secret = settings.worker_secret.get_secret_value().encode()
    signer = RequestSigner(settings.worker_signing_key.get_secret_value())
    # Published block keys are digests under the signing key: /state lets no one without it
    # check a guessed prompt against them (gateway/workers/key_log.py).
    digest = KeyDigest(settings.worker_signing_key.get_secret_value())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        _, engine = await run_in_threadpool(
            on_passing_thread, lambda: start_engine(settings, loaded)
        )
        name = settings.served_model_name or engine.loaded.name
        announce(f"worker: serving {name} (fingerprint {engine.loaded.fingerprint[:16]})")
        announce("engine: " + ", ".join(f"{k} {v}" for k, v in engine.describe().items()))
        app.state.worker = WorkerState(engine, name, digest)
        try:
            yield
        finally:
            app.state.worker.draining = True
            await run_in_threadpool(engine.stop, settings.shutdown_grace_s)

    def authorized(authorization: Annotated[str | None, Header()] = None) -> None:
        scheme, _, offered = (authorization or "").partition(" ")
        if scheme != "Bearer" or not hmac.compare_digest(offered.encode(), secret):
            raise _Refused(401, "invalid worker secret")

    def worker(request: Request) -> WorkerState:
        state: WorkerState = request.app.state.worker
        return state

    def check_signature(request: Request, view: dict[str, Any]) -> None:
        refusal = signer.verify(view, request.headers.get(SIGNATURE_HEADER))
        if refusal is not None:
            raise _Refused(403, _SIGNATURE_REFUSALS[refusal])

    async def signed_body(request: Request, action: str) -> dict[str, Any]:
        """An admin action's body, once its signature matched."""
        body = await _json(request)
        check_signature(request, action_view(action, body))
        return body

    app = FastAPI(  # internal: nothing to advertise
        title="PrefixGate worker",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    guarded = [Depends(authorized)]

    @app.exception_handler(_Refused)
    async def refused(_: Request, error: _Refused) -> JSONResponse:
        body = {"error": {"type": "WorkerRefusal", "message": error.message}}
        return JSONResponse(body, status_code=error.status)

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz(request: Request) -> JSONResponse:
        state = worker(request)
        ready = state.engine.running and not state.draining
        return JSONResponse({"ready": ready}, status_code=200 if ready else 503)

    @app.post("/internal/v1/generate", dependencies=guarded)
    async def generate(request: Request) -> Response:
        state = worker(request)
        if state.draining:
            return _error(errors.EngineStopped("the worker is draining"))
        body = await _json(request)
        check_signature(request, generation_view(body, state.engine.loaded.fingerprint))
        try:
            generation = await run_in_threadpool(
                wire.read_request, body, state.engine.grammars.compile_serialized
            )
        except wire.WireError as error:
            raise _Refused(400, str(error)) from None
        except InvalidSampling as error:
            return _error(errors.InvalidRequest(str(error), error.param))
        except errors.EngineError as error:
            return _error(error)
        stream = state.engine.generate(generation)
        try:
            first = await _first_unless_gone(request, stream)
        except _GatewayGone:  # it went away while the request waited: nobody to answer
            return Response(status_code=499)
        except errors.EngineError as error:
            return _error(error)
        except Exception:
            logger.exception("a request failed in the worker before its first delta")
            return _error(errors.EngineError("the worker failed"))
        return StreamingResponse(_lines(first, stream), media_type="application/x-ndjson")

    @app.get("/internal/v1/state", dependencies=guarded)
    async def worker_state(request: Request, since: int = 0, epoch: str | None = None) -> Any:
        state = worker(request)
        keys = await run_in_threadpool(state.keys.update, epoch, since, time.monotonic())
        waiting, running = state.engine.queue_depth()
        engine = state.engine
        return {
            "ready": engine.running and not state.draining,
            "model": state.model_name,
            "root": engine.root_key.hex(),
            "fingerprint": engine.loaded.fingerprint,
            "block_size": engine.pool.spec.block_size,
            "waiting": waiting,
            "running": running,
            "in_flight": engine.in_flight,
            "preemptions": engine.metrics.preemptions,
            "max_model_len": engine.max_model_len,
            "describe": engine.describe(),
            "stats": wire.stats_json(engine.cache_stats()),
            **activity_json(engine),
            "keys": {
                "epoch": keys.epoch,
                "seq": keys.seq,
                "full": keys.full,
                "added": keys.added,
                "removed": keys.removed,
            },
        }

    @app.get("/internal/v1/model", dependencies=guarded)
    async def model(request: Request) -> dict[str, Any]:
        state = worker(request)
        loaded = state.engine.loaded
        files = await run_in_threadpool(_shape_files, loaded.directory)
        tokenizer = loaded.tokenizer
        return {
            "name": state.model_name,
            "fingerprint": loaded.fingerprint,
            "chat_template": getattr(tokenizer, "chat_template", None),
            "files": files,
        }

    @app.post("/internal/v1/budgets", dependencies=guarded)
    async def budgets(request: Request) -> dict[str, int]:
        body = await signed_body(request, "budgets")
        try:
            changes = {
                wire.read_owner(str(item["owner"])): wire.read_budget(item["budget"])
                for item in body["budgets"]
            }
        except (KeyError, TypeError, ValueError) as error:
            raise _Refused(400, f"malformed budgets: {error!r}") from None
        try:
            evicted = await run_in_threadpool(worker(request).engine.set_budgets, changes)
        except ValueError as error:  # a reservation the pool cannot hold; the rest are set
            raise _Refused(400, str(error)) from None
        return {"blocks": evicted}

    @app.post("/internal/v1/purge", dependencies=guarded)
    async def purge(request: Request) -> dict[str, int]:
        body = await signed_body(request, "purge")
        tenant_id = body.get("tenant_id")
        if not isinstance(tenant_id, str) or not tenant_id:
            raise _Refused(400, "tenant_id must be a non-empty string")
        purged = await run_in_threadpool(worker(request).engine.purge_tenant, tenant_id)
        return {"blocks": purged}

    @app.post("/internal/v1/drop-public-prefix", dependencies=guarded)
    async def drop_public_prefix(request: Request) -> dict[str, int]:
        body = await signed_body(request, "drop-public-prefix")
        namespace, token_ids = body.get("namespace"), body.get("token_ids")
        if not isinstance(namespace, str) or not isinstance(token_ids, list):
            raise _Refused(400, "namespace must be a string and token_ids a list")
        if not all(type(token) is int for token in token_ids):
            raise _Refused(400, "token_ids must be integers")
        engine = worker(request).engine
        dropped = await run_in_threadpool(engine.drop_public_prefix, namespace, token_ids)
        return {"blocks": dropped}

    @app.post("/internal/v1/drain", dependencies=guarded)
    async def drain(request: Request) -> dict[str, bool]:
        worker(request).draining = True
        return {"draining": True}

    return app


class _GatewayGone(Exception):
    """The gateway closed the connection before the request's first delta."""


async def _first_unless_gone(request: Request, stream: AsyncIterator[Any]) -> Any:
    """The stream's first delta; if the gateway leaves first (the engine may still be queueing
    or prefilling), the request is cancelled at once and `_GatewayGone` raised. The stream is
    closed on every way out but success."""
    task = asyncio.ensure_future(anext(stream))
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise _GatewayGone
    except BaseException:
        if not task.done():
            task.cancel()
            with anyio.CancelScope(shield=True), contextlib.suppress(BaseException):
                await task
        with contextlib.suppress(Exception):
            await stream.aclose()  # type: ignore[attr-defined]
        raise


class _Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


async def _json(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.body())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise _Refused(400, f"the body is not JSON: {error}") from None
    if not isinstance(body, dict):
        raise _Refused(400, "the body must be a JSON object")
    return body


def _error(error: errors.EngineError) -> JSONResponse:
    return JSONResponse({"error": wire.error_json(error)}, status_code=status_of(error))


async def _lines(first: Any, stream: AsyncIterator[Any]) -> AsyncIterator[bytes]:
    """The deltas as JSON lines; an engine error mid-stream is the last line. Leaving early
    (the gateway went away) closes the engine stream, which cancels the request."""
    try:
        yield _line({"delta": wire.delta_json(first)})
        async for delta in stream:
            yield _line({"delta": wire.delta_json(delta)})
    except errors.EngineError as error:
        yield _line({"error": wire.error_json(error)})
    except asyncio.CancelledError:
        raise
    except Exception:
        logger.exception("a streamed request failed in the worker")
        yield _line({"error": wire.error_json(errors.EngineError("the worker failed"))})
    finally:  # shielded: the response's task group cancels every await once the gateway left
        with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
            await stream.aclose()  # type: ignore[attr-defined]


def _shape_files(directory: Path | None) -> dict[str, str]:
    """The served model's tokenizer and config files, base64-encoded (none for a model built in
    memory, which a gateway cannot serve from workers)."""
    if directory is None:
        return {}
    return {name: base64.b64encode(data).decode() for name, data in shape_files(directory).items()}


def _line(payload: dict[str, Any]) -> bytes:
    return json.dumps(payload, ensure_ascii=False).encode() + b"\n"
