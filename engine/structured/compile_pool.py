"""A small pool of processes that compile grammars, each compile within a time and a memory
limit (`CompileLimits`).

A costly schema (within the size limits of `schema_checks.py`) can take xgrammar seconds, or
gigabytes, to compile. So no compile runs in the serving process: a compile is a job sent to
one of a few processes (`compile_worker.py`), which answers with the compiled grammar as JSON.
A process that has not answered within the time limit is killed (SIGKILL) and the job refused
as too costly; one whose allocations fail at its memory limit answers so, or dies of it, and
the job is refused as needing too much memory. A killed process is replaced by the next job
that needs it.

Processes are forked from multiprocessing's fork server, never from the serving process (it
has threads; a fork would copy their locks held): the server imported xgrammar once, so a
process starts in tens of milliseconds rather than the second or two an import takes (the
fork server itself starts with the first process). A process does not run the serving
process's main script again either (`_Popen`): that would import the whole gateway, seconds
that the job after a killed compile would wait. They start when first needed, and end
when the pool closes, when it is garbage-collected or its process exits (multiprocessing
ends daemonic children then), or, should the serving process die, when their pipe closes
(between compiles) or their CPU limit runs out (during one).

A job waits at most `wait_s` for a free process, then is refused as `EngineOverloaded`.
"""

from __future__ import annotations

import io
import multiprocessing
import os
import queue
import threading
import weakref
from dataclasses import dataclass
from multiprocessing import forkserver, popen_forkserver, reduction, spawn, util
from multiprocessing.connection import Connection
from multiprocessing.context import ForkServerProcess, set_spawning_popen
from multiprocessing.process import BaseProcess
from typing import Any, Literal

from engine.errors import EngineOverloaded
from engine.structured import compile_worker
from engine.structured.compile_limits import CompileLimits
from engine.structured.compile_worker import Job

START_TIMEOUT_S = 60.0  # the fork server's first start imports xgrammar (and torch)
_CONTEXT = multiprocessing.get_context("forkserver")

FailureKind = Literal["timeout", "memory", "unreadable", "refused"]


class CompileFailed(Exception):
    """A job's compile failed: past a limit, or xgrammar could not read or compile it.

    `detail` is xgrammar's own text (for the unreadable and refused kinds): for logs and for
    classifying, never for a client.
    """

    def __init__(self, kind: FailureKind, detail: str = "") -> None:
        super().__init__(kind)
        self.kind = kind
        self.detail = detail


class CompilePool:
    """`limits.processes` compile processes for one vocabulary, started when first needed."""

    def __init__(self, tokenizer_info: str, limits: CompileLimits) -> None:
        self.limits = limits
        self._tokenizer_info = tokenizer_info  # `TokenizerInfo.serialize_json()`
        self._processes = [_CompileProcess() for _ in range(limits.processes)]
        self._idle: queue.Queue[_CompileProcess] = queue.Queue()
        for process in self._processes:
            self._idle.put(process)
        weakref.finalize(self, _kill_all, self._processes)

    def compile(self, job: Job, wait_s: float) -> str:
        """The compiled grammar of `job` as JSON (`CompiledGrammar.serialize_json`).

        Raises `EngineOverloaded` when no process is free within `wait_s` (or none starts),
        `CompileFailed` when the compile fails or passes a limit.
        """
        try:
            process = self._idle.get(timeout=wait_s)
        except queue.Empty:
            raise EngineOverloaded("another grammar is being compiled; retry shortly") from None
        try:
            return process.run(job, self._tokenizer_info, self.limits)
        finally:
            self._idle.put(process)

    def close(self) -> None:
        """End every process now (a compile under way is refused as `EngineOverloaded`);
        the next job starts them again."""
        _kill_all(self._processes)
        idle = []  # reaped here; one in use is reaped by its job's thread
        while True:
            try:
                idle.append(self._idle.get_nowait())
            except queue.Empty:
                break
        for process in idle:
            process.reap()
            self._idle.put(process)

    def pids(self) -> list[int]:
        """The ids of the processes running now."""
        return [pid for process in self._processes if (pid := process.pid) is not None]


@dataclass(slots=True)
class _Started:
    process: BaseProcess
    connection: Connection


class _CompileProcess:
    """One compile process, started when a job first needs it; one job at a time."""

    def __init__(self) -> None:
        self._started: _Started | None = None
        self._killed = False  # by `kill`: a job that finds its process gone was stopped
        self._lock = threading.Lock()  # between `kill` (any thread) and start/reap (the job's)

    @property
    def pid(self) -> int | None:
        started = self._started
        return started.process.pid if started is not None else None

    def run(self, job: Job, tokenizer_info: str, limits: CompileLimits) -> str:
        if self._killed or (self._started and not self._started.process.is_alive()):
            self.reap()
        started = self._started or self._start(tokenizer_info, limits)
        try:
            started.connection.send(job)
            if not started.connection.poll(limits.timeout_s):
                self.kill()
                self.reap()
                raise CompileFailed("timeout")
            answer = started.connection.recv_bytes()
        except (EOFError, OSError):  # it died: of its memory limit, unless it was stopped
            stopped = self._killed
            self.reap()
            if stopped:
                raise EngineOverloaded("the grammar compiler was stopped; retry") from None
            raise CompileFailed("memory") from None
        if answer[:1] == compile_worker.OUT_OF_MEMORY:
            self.reap()  # it ends itself after a failed allocation: the next job starts anew
        return _result(answer)

    def _start(self, tokenizer_info: str, limits: CompileLimits) -> _Started:
        # The fork server imports this module (and so the worker's, and xgrammar) once, for
        # every process: a process unpickles `_WorkerProcess` and runs `compile_worker.serve`.
        _CONTEXT.set_forkserver_preload([__name__])
        parent, child = _CONTEXT.Pipe()
        process = _WorkerProcess(
            target=compile_worker.serve,
            args=(child, tokenizer_info, limits.memory_mb, limits.timeout_s),
            name="grammar-compile",
            daemon=True,
        )
        process.start()
        child.close()
        with self._lock:
            self._started = _Started(process, parent)
        try:
            if parent.poll(START_TIMEOUT_S) and parent.recv_bytes() == compile_worker.READY:
                return self._started
        except (EOFError, OSError):
            pass
        self.kill()
        self.reap()
        raise EngineOverloaded("the grammar compiler could not start; retry shortly")

    def kill(self) -> None:
        """SIGKILL the process, if one runs (from any thread)."""
        with self._lock:
            if self._started is not None:
                self._killed = True
                self._started.process.kill()

    def reap(self) -> None:
        """Wait for a killed or dead process to end, and forget it (the job's thread)."""
        with self._lock:
            started, self._started, self._killed = self._started, None, False
        if started is not None:
            started.process.kill()
            started.process.join()
            started.connection.close()


def _result(answer: bytes) -> str:
    """The compiled grammar's JSON from a process's answer, or `CompileFailed`."""
    tag, body = answer[:1], answer[1:].decode(errors="replace")
    if tag == compile_worker.COMPILED:
        return body
    if tag == compile_worker.OUT_OF_MEMORY:
        raise CompileFailed("memory")
    raise CompileFailed("unreadable" if tag == compile_worker.UNREADABLE else "refused", body)


def _kill_all(processes: list[_CompileProcess]) -> None:
    for process in processes:
        process.kill()


class _WorkerProcess(ForkServerProcess):
    """A compile process, started by `_Popen`."""

    @staticmethod
    def _Popen(process_obj: Any) -> _Popen:
        return _Popen(process_obj)


# What would make the child run the parent's main script (or module) again, as `__mp_main__`.
_MAIN_KEYS = ("init_main_from_path", "init_main_from_name")


class _Popen(popen_forkserver.Popen):
    """The fork server's start of a process, less the main script.

    multiprocessing runs the parent's main script again in each child (to unpickle what it
    defines) unless the fork server preloaded it, and Python 3.11's fork server never does: it
    looks for a `main_path` that `get_preparation_data` does not give. For `prefixgate serve`
    that is an import of the whole gateway per compile process, seconds on a busy machine; the
    compile process needs nothing from it (its target is `compile_worker.serve`). So it is
    started as multiprocessing starts one (Python 3.11's `_launch`), with the main left out.
    """

    def _launch(self, process_obj: Any) -> None:
        prep_data = spawn.get_preparation_data(process_obj._name)
        for key in _MAIN_KEYS:
            prep_data.pop(key, None)
        buf = io.BytesIO()
        set_spawning_popen(self)
        try:
            reduction.dump(prep_data, buf)
            reduction.dump(process_obj, buf)
        finally:
            set_spawning_popen(None)
        fds: list[int] = self._fds  # type: ignore[attr-defined]  # the base class's
        self.sentinel, w = forkserver.connect_to_new_process(fds)
        # A duplicate of the data pipe's write end: the child's sign that its parent lives.
        parent_w = os.dup(w)
        self.finalizer = util.Finalize(self, _close_fds, (parent_w, self.sentinel))
        with open(w, "wb", closefd=True) as data:
            data.write(buf.getbuffer())
        self.pid = forkserver.read_signed(self.sentinel)


def _close_fds(*fds: int) -> None:
    for fd in fds:
        os.close(fd)
