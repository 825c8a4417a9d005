"""A gateway learns a model from a worker it trusts, and still takes nothing from it but a
model's tokenizer and config files: a worker (here a hostile one, on a real socket) that sends
other file names, a malformed fingerprint or another model than it announced is refused, and
nothing is written outside the catalog's own directory."""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.workers.models import ModelCatalog

FINGERPRINT = "ab" * 32


class HostileWorker:
    """Answers GET /internal/v1/model with whatever body the test sets."""

    def __init__(self) -> None:
        self.body: dict[str, Any] = {}
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                payload = json.dumps(outer.body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *_: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def worker() -> Iterator[HostileWorker]:
    hostile = HostileWorker()
    yield hostile
    hostile.server.shutdown()


@pytest.fixture
def catalog() -> Iterator[ModelCatalog]:
    opened = ModelCatalog(httpx.Client(timeout=5))
    yield opened
    opened.close()


def shape(tiny_chat_dir: Path) -> dict[str, str]:
    wanted = ("config.json", "tokenizer.json", "tokenizer_config.json")
    return {name: base64.b64encode((tiny_chat_dir / name).read_bytes()).decode() for name in wanted}


def test_a_model_is_loaded_from_its_tokenizer_and_config_alone(
    worker: HostileWorker, catalog: ModelCatalog, tiny_chat_dir: Path
) -> None:
    worker.body = {"name": "m", "fingerprint": FINGERPRINT, "chat_template": "{{ 'x' }}",
                   "files": shape(tiny_chat_dir)}  # fmt: skip
    assert catalog.adopt(worker.url, "m", FINGERPRINT) is None
    loaded = catalog.get(FINGERPRINT)
    assert loaded is not None and loaded.name == "m" and loaded.fingerprint == FINGERPRINT
    assert loaded.tokenizer.chat_template == "{{ 'x' }}"
    assert loaded.tokenizer.encode("hello") == catalog.get(FINGERPRINT, "alias").tokenizer.encode(
        "hello"
    )  # an alias is the same model under another name
    assert catalog.get(FINGERPRINT, "alias").name == "alias"  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "name",
    ["../escaped.json", "sub/tokenizer.json", "model.safetensors", "..", "run.sh"],
)
def test_only_a_models_shape_files_are_taken(
    name: str, worker: HostileWorker, catalog: ModelCatalog, tiny_chat_dir: Path, tmp_path: Path
) -> None:
    files = {**shape(tiny_chat_dir), name: base64.b64encode(b"{}").decode()}
    worker.body = {"name": "m", "fingerprint": FINGERPRINT, "files": files}
    refused = catalog.adopt(worker.url, "m", FINGERPRINT)
    assert refused is not None and "should not" in refused
    assert catalog.get(FINGERPRINT) is None
    written = list(catalog._directory.rglob("*"))
    assert written == [], written  # every name is checked before anything is written


def test_a_worker_announcing_one_model_and_sending_another_is_refused(
    worker: HostileWorker, catalog: ModelCatalog, tiny_chat_dir: Path
) -> None:
    worker.body = {"name": "other", "fingerprint": FINGERPRINT, "files": shape(tiny_chat_dir)}
    refused = catalog.adopt(worker.url, "m", FINGERPRINT)
    assert refused is not None and "changed" in refused
    for fingerprint in ("../../etc", "AB" * 32, "ab" * 31):
        bad = catalog.adopt(worker.url, "m", fingerprint)
        assert bad is not None and "malformed model fingerprint" in bad
    assert catalog.adopt(worker.url, "\n", FINGERPRINT) is not None  # not a printable name
