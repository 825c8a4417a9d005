"""`prefixgate serve --demo` as `make run` starts it: SQLite, the embedded model, a real process."""

from __future__ import annotations

import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai

from bench.local_server import free_port


def _ready(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/readyz").status_code == 200
    except httpx.ConnectError:
        return False


def test_serve_demo_answers_and_drains_streams_on_shutdown(
    tmp_path: Path, smollm2_dir: Path
) -> None:
    port = free_port()
    env = {**os.environ, "PREFIXGATE_STATE_DIR": str(tmp_path / "state"),
           "PREFIXGATE_DATABASE_URL": f"sqlite:///{tmp_path / 'prefixgate.db'}"}  # fmt: skip
    executable = shutil.which("prefixgate") or f"{sys.prefix}/bin/prefixgate"
    process = subprocess.Popen(
        [executable, "serve", "--demo", "--port", str(port)], cwd=tmp_path, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in process.stdout or []],
                              daemon=True)  # fmt: skip
    reader.start()
    output: list[str] = []
    key = None
    try:
        deadline = time.monotonic() + 180
        while key is None and time.monotonic() < deadline:
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                assert process.poll() is None, "".join(output)
                continue
            output.append(line)
            if line.strip().startswith("pgk_"):
                key = line.strip()
        assert key is not None, "".join(output)
        assert any("created the database schema" in line for line in output)
        assert not any("first start" in line for line in output)  # --demo made them already
        while not _ready(port):  # the demo's lines come before the server listens
            time.sleep(0.1)
        while not lines.empty():
            output.append(lines.get())
        console_lines = [line for line in output if line.startswith("console: ")]
        assert console_lines and "password (shown only now)" in console_lines[0], output
        api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0)
        answer = api.chat.completions.create(
            model="smollm2-135m-instruct",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            temperature=0,
            max_tokens=24,
        )
        assert "Paris" in (answer.choices[0].message.content or "")

        stream = api.chat.completions.create(
            model="smollm2-135m-instruct",
            messages=[{"role": "user", "content": "Write a long story about the sea."}],
            temperature=0, max_tokens=40, stream=True,
        )  # fmt: skip
        first = next(iter(stream))
        assert first.choices[0].delta.role == "assistant"
        process.send_signal(signal.SIGTERM)  # shut down while the stream is in flight
        rest = list(stream)
        assert rest[-1].choices[0].finish_reason == "length"  # it was drained, not cut
        # uvicorn finishes its graceful shutdown, then re-raises SIGTERM as its exit status.
        assert process.wait(timeout=60) in (0, -signal.SIGTERM)
        reader.join(10)
        while not lines.empty():
            output.append(lines.get())
        assert any("Application shutdown complete" in line for line in output), "".join(output)
    finally:
        if process.poll() is None:
            process.kill()
