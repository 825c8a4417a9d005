"""The gateway in this process: a real uvicorn server on a localhost port, in a thread.

For benchmarks and tests that need a running server and also its internals (the engine's
pool, the audit queue). `tiny_chat_model` builds a small random Llama with the embedded
SmolLM2 tokenizer, so the HTTP path is exercised with a real chat template at low cost.
"""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import httpx
import torch
import uvicorn
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from gateway.app import create_app
from gateway.http.connections import uvicorn_config
from gateway.settings import Settings
from gateway.state import GatewayState


def wait_until_ready(
    url: str,
    process: subprocess.Popen[bytes],
    log: Path,
    timeout_s: float = 300,
    verify: ssl.SSLContext | bool = True,
) -> None:
    """Until `url`/readyz answers 200; RuntimeError with the end of the process's log if it
    exits or takes longer than `timeout_s`. `verify` is the TLS context to call it with (a
    worker over mutual TLS asks for a client certificate before it answers anything)."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(verify=verify, timeout=2) as client:
        while time.monotonic() < deadline and process.poll() is None:
            try:
                if client.get(f"{url}/readyz").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
    why = "exited" if process.poll() is not None else f"was not ready within {timeout_s:g} s"
    raise RuntimeError(f"{url} {why}:\n{log.read_text(errors='replace')[-3000:]}")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def tiny_chat_model(
    directory: Path,
    tokenizer_dir: Path,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_hidden_layers: int = 2,
    max_position_embeddings: int = 2048,
    architecture: Literal["llama", "qwen2"] = "llama",
) -> Path:
    """A small seeded random Llama (or Qwen2) with SmolLM2's real tokenizer and chat template."""
    torch.manual_seed(0)
    if architecture == "qwen2":  # another architecture: biased Q/K/V projections
        Qwen2ForCausalLM(
            Qwen2Config(
                vocab_size=49152,
                hidden_size=hidden_size,
                intermediate_size=intermediate_size,
                num_hidden_layers=num_hidden_layers,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=max_position_embeddings,
                bos_token_id=1,
                eos_token_id=2,
                tie_word_embeddings=True,
            )
        ).save_pretrained(directory)
        return _with_tokenizer(directory, tokenizer_dir)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(directory)
    return _with_tokenizer(directory, tokenizer_dir)


def _with_tokenizer(directory: Path, tokenizer_dir: Path) -> Path:
    for path in tokenizer_dir.iterdir():
        if path.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(path, directory / path.name)
    return directory


class RunningServer:
    def __init__(self, server: uvicorn.Server, thread: threading.Thread, port: int) -> None:
        self.server = server
        self.thread = thread
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.state: GatewayState | None = None

    @property
    def gateway(self) -> GatewayState:
        assert self.state is not None
        return self.state


@contextmanager
def serve(settings_overrides: dict[str, Any], loaded: Any = None) -> Iterator[RunningServer]:
    """Start the gateway; yields once it answers, stops it (gracefully) afterwards."""
    port = free_port()
    settings = Settings(host="127.0.0.1", port=port, **settings_overrides)
    holder: dict[str, GatewayState] = {}

    def remember(state: GatewayState) -> None:
        holder["state"] = state

    app = create_app(settings, loaded=loaded, announce=lambda _: None, on_ready=remember)
    config = uvicorn_config(app, settings, log_level="warning", timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the gateway did not start")
        time.sleep(0.05)
    running = RunningServer(server, thread, port)
    running.state = holder["state"]
    try:
        yield running
    finally:
        server.should_exit = True
        thread.join(30)
