"""Write a real env file from an example: every `NAME=CHANGE_ME` line gets a random value.

    python3 deploy/generate_secrets.py deploy/compose.env.example deploy/compose.env

The new file is mode 0600, and an existing one is never overwritten: a new key-hashing secret
would invalidate every stored API key, and the database refuses a process whose secrets are
not the ones it was set up with. Values that only *contain* CHANGE_ME (a database URL's
password, say) are left for you to edit; the command names them. `${NAME}` in a value becomes
the value of NAME set on a line above (so `REDIS_URL=redis://:${REDIS_PASSWORD}@redis:6379/0`
gets the password generated for REDIS_PASSWORD); a name not set above is left as it is.
Standard library only.
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import sys
from pathlib import Path

PLACEHOLDER = "CHANGE_ME"
REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def filled(example: str) -> tuple[str, list[str]]:
    """The example's text with every whole-value placeholder replaced by a random secret and
    every `${NAME}` of a name set above replaced by its value, and the names whose values
    still hold a placeholder."""
    lines: list[str] = []
    unfilled: list[str] = []
    values: dict[str, str] = {}
    for line in example.splitlines():
        name, equals, value = line.partition("=")
        if line.lstrip().startswith("#") or not equals:
            lines.append(line)
            continue
        if value.strip() == PLACEHOLDER:
            # URL-safe: it can go into a database URL or a shell line without quoting.
            value = secrets.token_urlsafe(32)
        else:
            value = REFERENCE.sub(lambda match: values.get(match[1], match[0]), value)
            if PLACEHOLDER in value:
                unfilled.append(name.strip())
        values[name.strip()] = value
        lines.append(f"{name}={value}")
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
