"""Private paths: the state directory and what it holds belong to the deployment's user alone.

Whoever creates the state directory first (the gateway, a worker, any `prefixgate` command) or
the directory of a database, spool or checkpoint file, creates it mode 0700 and the file 0600,
whatever the umask: secrets, the SQLite database and the audit files are never listed or read
by another local user. Only the directory itself is made private; parents that are missing
are created as the system would (`~/.local/state` is the user's, not ours).
"""

from __future__ import annotations

import os
from pathlib import Path

PRIVATE_DIRECTORY = 0o700
PRIVATE_FILE = 0o600


def private_directory(path: Path) -> None:
    """Create `path` mode 0700 (missing parents as usual) unless it exists; an existing
    directory keeps its mode, since an operator may have set it (a mounted volume's group)."""
    if path.is_dir():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.mkdir(mode=PRIVATE_DIRECTORY)
    except FileExistsError:
        return  # another process created it first, with the same mode
    os.chmod(path, PRIVATE_DIRECTORY)  # mkdir's mode passes through the umask


def create_private_file(path: Path) -> None:
    """Create `path` empty and mode 0600, in a private directory, unless it exists; an
    existing file keeps its mode."""
    private_directory(path.parent)
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE)
    except FileExistsError:
        return
    try:
        os.fchmod(descriptor, PRIVATE_FILE)  # the open's mode passes through the umask
    finally:
        os.close(descriptor)
