"""The models a routing gateway serves: every model its workers announce.

A worker announces the model it serves by name (the id clients send) and fingerprint (a digest
of its weights, tokenizer and config: engine/model/loader.py). The gateway tokenizes and
templates requests itself, so the first time it meets a fingerprint it fetches that model's
tokenizer and config files from the worker (`GET /internal/v1/model`; no weights) and loads
its shape. Workers are trusted (they hold the worker secret); the answer is checked all the
same: its size (`MAX_SHAPE_BYTES` of files at most), every file's name (a tokenizer's or a
config's, no path) before anything is written, and the name and fingerprint it announced.

A fingerprint may be served under two names (an alias): each name is a model of its own for
clients and for public prefixes, computed alike (the same weights give the same cache keys).
A name may be served under two fingerprints at once (a rolling update of a model's weights):
each fingerprint keeps its own tokenizer, and its own cache keys on its workers; requests for
the name go to the fingerprint with the most workers in routing, the one met first while they
are as many (remote_engine.py), so a rolling update switches once the new weights have more
workers, not back and forth.
"""

from __future__ import annotations

import base64
import dataclasses
import itertools
import json
import logging
import re
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

import httpx

from engine.model.loader import (
    MAX_SHAPE_BYTES,
    LoadedModel,
    ModelLoadError,
    is_shape_file,
    load_shape,
)

logger = logging.getLogger(__name__)
_FINGERPRINT = re.compile(r"[0-9a-f]{64}")  # a SHA-256 digest (engine/model/loader.py)
# The files as base64 (4 bytes for 3) in JSON, with room for the rest of the answer.
_MAX_ANSWER_BYTES = MAX_SHAPE_BYTES * 4 // 3 + (1 << 20)
MAX_MODEL_NAME = 256


class ModelCatalog:
    """Each fingerprint's shape and tokenizer, loaded once from a worker that serves it."""

    def __init__(self, client: httpx.Client) -> None:
        self._client = client
        self._lock = threading.Lock()
        self._loaded: dict[str, LoadedModel] = {}
        self._met: dict[str, int] = {}  # when each fingerprint was first loaded (a count)
        self._meetings = itertools.count()
        self._loading: dict[str, threading.Lock] = {}  # one fetch per fingerprint at a time
        self._directory = Path(tempfile.mkdtemp(prefix="prefixgate-models-"))

    def get(self, fingerprint: str, name: str | None = None) -> LoadedModel | None:
        """The model of this fingerprint (under `name`, if given: an alias's name)."""
        with self._lock:
            loaded = self._loaded.get(fingerprint)
        if loaded is None or name is None or name == loaded.name:
            return loaded
        return dataclasses.replace(loaded, name=name)

    def adopt(self, worker_url: str, name: str, fingerprint: str) -> str | None:
        """Make sure the model a worker announced is loaded (from that worker, the first time);
        None when the worker may serve it, else why it may not."""
        if not _FINGERPRINT.fullmatch(fingerprint):
            return f"it announced a malformed model fingerprint {fingerprint[:80]!r}"
        if not 0 < len(name) <= MAX_MODEL_NAME or not name.isprintable():
            return f"it announced a malformed model name {name[:80]!r}"
        with self._lock:
            known = self._loaded.get(fingerprint)
            gate = self._loading.setdefault(fingerprint, threading.Lock())
        if known is not None:
            return None
        with gate:
            with self._lock:
                known = self._loaded.get(fingerprint)
            if known is not None:
                return None
            try:
                loaded = self._fetch(worker_url, name, fingerprint)
            except (httpx.HTTPError, ValueError, KeyError, TypeError, ModelLoadError) as error:
                return f"could not load its model {name!r}: {error}"
            with self._lock:
                self._loaded[fingerprint] = loaded
                self._met[fingerprint] = next(self._meetings)
        logger.info("model %s (%s) is served by engine workers", name, fingerprint[:12])
        return None

    def met(self, fingerprint: str) -> int:
        """Orders fingerprints by when they were first loaded (earlier: smaller)."""
        with self._lock:
            return self._met.get(fingerprint, 1 << 62)

    def forget_except(self, fingerprints: set[str]) -> None:
        """Drop the models no known worker serves any more."""
        with self._lock:
            gone = [fp for fp in self._loaded if fp not in fingerprints]
            for fingerprint in gone:
                del self._loaded[fingerprint]
                self._loading.pop(fingerprint, None)
                self._met.pop(fingerprint, None)
        for fingerprint in gone:
            shutil.rmtree(self._directory / fingerprint, ignore_errors=True)

    def close(self) -> None:
        shutil.rmtree(self._directory, ignore_errors=True)

    def _fetch(self, worker_url: str, name: str, fingerprint: str) -> LoadedModel:
        with self._client.stream("GET", f"{worker_url}/internal/v1/model") as response:
            response.raise_for_status()
            chunks, size = [], 0
            for chunk in response.iter_bytes():
                size += len(chunk)
                if size > _MAX_ANSWER_BYTES:
                    raise ValueError(f"its model's files exceed {MAX_SHAPE_BYTES} bytes")
                chunks.append(chunk)
        body: dict[str, Any] = json.loads(b"".join(chunks))
        if body["name"] != name or body["fingerprint"] != fingerprint:
            raise ValueError("the worker's model changed while it was fetched")
        files = dict(body["files"])
        for file_name in files:  # every name checked before anything is written
            if not is_shape_file(str(file_name)):
                raise ValueError(f"the worker sent a file it should not: {str(file_name)[:80]!r}")
        target = self._directory / fingerprint
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        for file_name, content in files.items():
            (target / file_name).write_bytes(base64.b64decode(content, validate=True))
        template = body.get("chat_template")
        chat_template = template if isinstance(template, str) else None
        return load_shape(target, name, fingerprint, chat_template)
