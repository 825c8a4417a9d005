"""`prefixgate settings`: every setting, its PREFIXGATE_* variable, default and meaning.

The list is read from `Settings.model_fields`, never written out by hand, so a new setting
shows up here (and in `serve --help`'s pointer to it) the moment it is declared.
"""

from __future__ import annotations

import textwrap
from dataclasses import asdict, dataclass
from typing import Annotated, Any

import typer

from gateway.cli.common import app, one_line, print_json

UNSET = "(unset)"
DESCRIPTION_WIDTH = 84  # indented by four: fits an 88-column terminal


@dataclass(frozen=True, slots=True)
class SettingDoc:
    """One setting as an operator sees it: its name, variable, default and description."""

    name: str
    env: str
    default: Any
    description: str


def setting_docs() -> list[SettingDoc]:
    """Every field of `Settings`, in declaration order, with the default it has here."""
    from gateway.settings import Settings

    prefix = Settings.model_config.get("env_prefix", "")
    return [
        SettingDoc(
            name=name,
            env=f"{prefix}{name}".upper(),
            # Factories run as a fresh process would run them: `state_dir` follows
            # $XDG_STATE_HOME and the default database lives in that state directory.
            default=field.get_default(call_default_factory=True, validated_data={}),
            # A multi-line attribute docstring reads as one paragraph.
            description=one_line(field.description or ""),
        )
        for name, field in Settings.model_fields.items()
    ]


def env_text(value: Any) -> str:
    """A default as it would be written in the environment (`true`, `10.0.0.1,10.1.0.0/16`)."""
    if value is None:
        return UNSET
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list | tuple):
        return ",".join(map(str, value)) or "(empty)"
    return str(value)


@app.command("settings")
def settings_list(
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON array.")] = False,
) -> None:
    """List every setting with its PREFIXGATE_* variable, default and description."""
    docs = setting_docs()
    if as_json:
        print_json([asdict(doc) for doc in docs])  # paths print as text
        return
    typer.echo("Every setting is an environment variable (or a line in .env in the working")
    typer.echo("directory); the variable wins over .env, and unset settings take the default.\n")
    width = max(len(doc.env) for doc in docs)
    for doc in docs:
        typer.echo(f"{doc.env:<{width}}  {env_text(doc.default)}")
        for line in textwrap.wrap(doc.description, width=DESCRIPTION_WIDTH):
            typer.echo(f"    {line}")
