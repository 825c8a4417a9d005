"""The audit log's local files: spool, dead letters and checkpoints, each append-only JSONL.

Every file is private (mode 0600, tightened if it already existed looser) and every append is
one `write` followed by `fsync`, so a crash can only leave a torn *last* line: one without its
newline. Readers skip such a line and say so; any other line that does not parse is corrupt.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tenancy.errors import TenancyError
from tenancy.private_paths import PRIVATE_FILE, private_directory


class UnreadableAuditFile(TenancyError):
    """An audit file (export, checkpoint file) is missing, not text, or not in our format."""


@dataclass(frozen=True, slots=True)
class JsonLines:
    """What a JSONL file held: its parsed objects, and raw lines that were not objects."""

    objects: list[dict[str, Any]]
    bad_lines: list[str]


@dataclass(frozen=True, slots=True)
class SignedCheckpoint:
    """A line of the external checkpoint file: the chain reached `seq` with `hash`."""

    seq: int
    hash: str
    signature: str

    def to_json(self) -> dict[str, Any]:
        return {"seq": self.seq, "hash": self.hash, "signature": self.signature}


def append_lines(path: Path, lines: list[str]) -> None:
    """Append whole lines durably (one write, fsync); creates the file private."""
    if not lines:
        return
    data = "".join(line + "\n" for line in lines).encode("utf-8")
    with _open_private(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT) as descriptor:
        os.write(descriptor, data)
        os.fsync(descriptor)


def replace_lines(path: Path, lines: Sequence[str | bytes]) -> None:
    """Atomically replace a file's content (temporary file, fsync, rename).

    A line given as bytes is written as it is (a line kept verbatim, whatever it holds).
    """
    data = b"".join(
        (line.encode("utf-8") if isinstance(line, str) else line) + b"\n" for line in lines
    )
    temporary = path.with_name(path.name + ".tmp")
    with _open_private(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC) as descriptor:
        os.write(descriptor, data)
        os.fsync(descriptor)
    temporary.replace(path)


def read_lines(path: Path) -> JsonLines:
    """Parse a JSONL file we wrote; a missing file is empty."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return JsonLines([], [])
    objects: list[dict[str, Any]] = []
    bad_lines: list[str] = []
    for raw in data.splitlines():
        text = raw.decode("utf-8", errors="replace")
        try:
            value = json.loads(text)
        except ValueError:
            value = None
        if isinstance(value, dict):
            objects.append(value)
        elif text.strip():
            bad_lines.append(text)
    return JsonLines(objects, bad_lines)


def count_lines(path: Path) -> int:
    """Complete lines in a file (0 if it does not exist)."""
    try:
        with open(path, "rb") as handle:
            return sum(chunk.count(b"\n") for chunk in iter(lambda: handle.read(1 << 16), b""))
    except FileNotFoundError:
        return 0


def dumps(value: Any) -> str:
    """One JSON line; ASCII so no string (not even a lone surrogate) can fail to encode."""
    return json.dumps(value, ensure_ascii=True, default=str)


@contextmanager
def locked(path: Path) -> Iterator[None]:
    """Serialise processes sharing `path` (an exclusive lock on `<path>.lock`)."""
    private_directory(path.parent)
    with _open_private(Path(f"{path}.lock"), os.O_RDWR | os.O_CREAT) as descriptor:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(descriptor, fcntl.LOCK_UN)


def append_checkpoint(path: Path, checkpoint: SignedCheckpoint) -> None:
    """Add a signed checkpoint to the external checkpoint file."""
    with locked(path):
        append_lines(path, [dumps(checkpoint.to_json())])


def read_checkpoints(path: Path) -> list[SignedCheckpoint]:
    """Every checkpoint in the file; a torn last line (a crash mid-append) is skipped."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    except OSError as error:
        raise UnreadableAuditFile(f"cannot read {path}: {error.strerror}") from error
    lines = data.split(b"\n")
    # The part after the last newline is either empty or a torn append; never evidence.
    checkpoints = []
    for number, raw in enumerate(lines[:-1], start=1):
        try:
            value = json.loads(raw.decode("utf-8"))
            checkpoints.append(
                SignedCheckpoint(_int(value["seq"]), _str(value["hash"]), _str(value["signature"]))
            )
        except (ValueError, KeyError, TypeError) as error:
            raise UnreadableAuditFile(f"{path} line {number} is not a checkpoint") from error
    return checkpoints


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError("not an integer")
    return value


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError("not a string")
    return value


@contextmanager
def _open_private(path: Path, flags: int) -> Iterator[int]:
    private_directory(path.parent)
    descriptor = os.open(path, flags, PRIVATE_FILE)
    try:
        # A file created by an older version (or another umask) is made private too.
        if os.fstat(descriptor).st_mode & 0o777 != PRIVATE_FILE:
            os.fchmod(descriptor, PRIVATE_FILE)
        yield descriptor
    finally:
        os.close(descriptor)
