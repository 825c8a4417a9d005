"""Engine workers as processes on this machine (`prefixgate worker`), for tests and benchmarks."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from bench.local_server import free_port, wait_until_ready


@dataclass
class ServerProcess:
    """A `prefixgate` server (a worker, a gateway) in a process of its own: its URL and log."""

    process: subprocess.Popen[bytes]
    url: str
    log: Path

    def kill(self) -> None:
        """Die at once, as a crashed machine would (no drain, no goodbye)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)


LocalWorker = ServerProcess  # an engine worker


@contextmanager
def worker_process(
    model_dir: Path | None,
    secret: str,
    log_dir: Path,
    environment: dict[str, str] | None = None,
    start_timeout_s: float = 180.0,
) -> Iterator[LocalWorker]:
    """A `prefixgate worker` on a free localhost port, ready when yielded, stopped after."""
    port = free_port()
    env = {**os.environ, **(environment or {}), "PREFIXGATE_WORKER_SECRET": secret}
    command = [_prefixgate(), "worker", "--host", "127.0.0.1", "--port", str(port)]
    if model_dir is not None:
        command += ["--model", str(model_dir)]
    log = log_dir / f"worker-{port}.log"
    with log.open("wb") as output:
        process = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT)
    worker = LocalWorker(process, f"http://127.0.0.1:{port}", log)
    try:
        wait_until_ready(worker.url, process, log, start_timeout_s)
        yield worker
    finally:
        stop(process)


def stop(process: subprocess.Popen[bytes], grace_s: float = 60.0) -> None:
    """Ask a server process to stop (SIGTERM: it finishes what it serves), then make it."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


@contextmanager
def worker_processes(
    count: int, model_dir: Path | None, secret: str, log_dir: Path, **options: object
) -> Iterator[list[LocalWorker]]:
    """`count` workers, started one after another (each loads the model)."""
    with ExitStack() as stack:
        yield [
            stack.enter_context(worker_process(model_dir, secret, log_dir, **options))  # type: ignore[arg-type]
            for _ in range(count)
        ]


def _prefixgate() -> str:
    """The `prefixgate` script of this interpreter's environment."""
    beside = Path(sys.executable).with_name("prefixgate")
    return str(beside) if beside.exists() else shutil.which("prefixgate") or "prefixgate"
