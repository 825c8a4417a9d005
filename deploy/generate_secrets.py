"""Write a real env file from an example: every `NAME=CHANGE_ME` line gets a random value.

    python3 deploy/generate_secrets.py deploy/compose.env.example deploy/compose.env

The new file is mode 0600, and an existing one is never overwritten: a new key-hashing secret
would invalidate every stored API key, and the database refuses a process whose secrets are
not the ones it was set up with. Values that only *contain* CHANGE_ME (a database URL's
password, say) are left for you to edit; the command names them. Standard library only.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
from pathlib import Path

PLACEHOLDER = "CHANGE_ME"


def filled(example: str) -> tuple[str, list[str]]:
    """The example's text with every whole-value placeholder replaced by a random secret, and
    the names whose values still hold a placeholder."""
    lines: list[str] = []
    unfilled: list[str] = []
    for line in example.splitlines():
        name, equals, value = line.partition("=")
        if line.lstrip().startswith("#") or not equals:
            lines.append(line)
        elif value.strip() == PLACEHOLDER:
            # URL-safe: it can go into a database URL or a shell line without quoting.
            lines.append(f"{name}={secrets.token_urlsafe(32)}")
        else:
            if PLACEHOLDER in value:
                unfilled.append(name.strip())
            lines.append(line)
    return "\n".join(lines) + "\n", unfilled


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "example", type=Path, help="the committed example, e.g. compose.env.example"
    )
    parser.add_argument("output", type=Path, help="the env file to create (never overwritten)")
    args = parser.parse_args()
    text, unfilled = filled(args.example.read_text())
    try:
        descriptor = os.open(args.output, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        print(f"{args.output} exists; not overwriting its secrets", file=sys.stderr)
        return 1
    with os.fdopen(descriptor, "w") as handle:
        handle.write(text)
    print(f"wrote {args.output}", file=sys.stderr)
    for name in unfilled:
        print(f"edit {name} in {args.output}: it still holds {PLACEHOLDER}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
