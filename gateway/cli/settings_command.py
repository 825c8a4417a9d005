"""`prefixgate settings`: every setting, the value in effect here, where that value comes from,
its default and meaning; and the defaults in effect in the --help of commands whose options
stand for settings.

The list is read from `Settings.model_fields`, never written out by hand, so a new setting
shows up here (and in `serve --help`'s pointer to it) the moment it is declared. A value comes
from a command's option, else a PREFIXGATE_* environment variable, else a line of .env in the
working directory, else the setting's default. A secret's value is never printed: only
whether it is set, and where.
"""

from __future__ import annotations

import os
import textwrap
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from typer._click import Context, HelpFormatter
from typer.core import TyperCommand, TyperOption

from gateway.cli.common import (
    app,
    env_file_unreadable,
    one_line,
    print_json,
    setting_problems,
)

if TYPE_CHECKING:
    from pydantic import ValidationError
    from pydantic.fields import FieldInfo

    from gateway.settings import Settings

UNSET = "(unset)"
HIDDEN = "(set, hidden)"
DEFAULT = "default"
DESCRIPTION_WIDTH = 84  # indented by four: fits an 88-column terminal


@dataclass(frozen=True, slots=True)
class GivenValue:
    """A setting's text as the environment or a .env file gives it, and which one gave it."""

    text: str
    source: str  # the variable's name, or the .env file's path


@dataclass(frozen=True, slots=True)
class SettingDoc:
    """One setting as an operator sees it: the value in effect here and where it comes from,
    the default it would have here, whether it is refused, and what it means."""

    name: str
    env: str
    value: Any  # a secret's is HIDDEN or None, never the secret
    source: str  # the variable's name, the .env file's path, or "default"
    default: Any
    secret: bool
    error: str | None  # why the value is refused (every other command refuses it too)
    description: str


def given_values() -> dict[str, GivenValue]:
    """The settings given outside the code, by name: .env lines, overridden by the environment.

    Read by pydantic-settings' own sources, so names match as `Settings` matches them.
    """
    from pydantic_settings import DotEnvSettingsSource, EnvSettingsSource

    from gateway.settings import Settings

    names = {_source_key(env_name(name)): name for name in Settings.model_fields}
    given: dict[str, GivenValue] = {}
    for path in _env_files():
        for key, text in DotEnvSettingsSource(Settings, env_file=path).env_vars.items():
            if key in names and text is not None:
                given[names[key]] = GivenValue(text, str(path))
    spelled = {_source_key(variable): variable for variable in os.environ}
    for key, text in EnvSettingsSource(Settings).env_vars.items():
        if key in names and text is not None:
            given[names[key]] = GivenValue(text, spelled.get(key, key))
    return given


def setting_docs() -> tuple[list[SettingDoc], list[str]]:
    """Every field of `Settings` in declaration order as it stands here, and the refusals of
    rules across settings (which no one setting is to blame for)."""
    from pydantic import ValidationError

    from gateway.settings import Settings

    given = given_values()
    refused: dict[str, str] = {}
    try:
        settings = Settings()
    except ValidationError as error:
        refused = _refusals(error)
        # Once more with the refused settings at their defaults: the rules across settings
        # are checked too (a refused value stops validation before them), and every other
        # value shows as validation makes it (`~` expanded, say)...
        defaults = {name: _default(Settings.model_fields[name], {}) for name in refused if name}
        try:
            settings = Settings(**defaults)
        except ValidationError as conflict:  # ...then without those rules, which refused them
            refused |= _refusals(conflict)
            settings = _fields_only(Settings)(**defaults)
    values = {name: getattr(settings, name) for name in Settings.model_fields}
    docs = []
    for name, field in Settings.model_fields.items():
        value = given[name].text if name in refused and name in given else values[name]
        docs.append(
            SettingDoc(
                name=name,
                env=env_name(name),
                value=_printable(value, field),
                source=given[name].source if name in given else DEFAULT,
                # What this setting would be if it were unset here: a default that follows
                # another setting (the database in the state directory) follows its value.
                default=_default(field, values),
                secret=_is_secret(field),
                error=refused.get(name),
                # A multi-line attribute docstring reads as one paragraph.
                description=one_line(field.description or ""),
            )
        )
    return docs, [reason for where, reason in refused.items() if not where]


def shown(value: Any, listed: bool = False) -> Any:
    """A value as it may be printed: each URL's password (a database's, Redis's) as ***.

    `listed`: the value is a list setting's text, its items separated by commas (a comma
    elsewhere may be a password's).
    """
    from gateway.settings import without_credentials

    if isinstance(value, list | tuple):
        return [shown(item) for item in value]
    if not isinstance(value, str):
        return value
    if listed:
        return ",".join(without_credentials(item) for item in value.split(","))
    return without_credentials(value)


def env_name(setting: str) -> str:
    """The environment variable of a setting (`PREFIXGATE_STATE_DIR`)."""
    from gateway.settings import Settings

    return f"{Settings.model_config.get('env_prefix', '')}{setting}".upper()


def env_text(value: Any) -> str:
    """A value as it would be written in the environment (`true`, `10.0.0.1,10.1.0.0/16`)."""
    if value is None:
        return UNSET
    if value == "":
        return '""'
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list | tuple):
        return ",".join(map(str, value)) or "(empty)"
    return str(value)


def origin_text(doc: SettingDoc) -> str:
    """Where a value comes from and, if it is not the default, what the default is."""
    if doc.source == DEFAULT:
        return "(default)"
    return f"(from {doc.source}; default: {env_text(doc.default)})"


@app.command(
    "settings", short_help="List every setting with its value in effect, source and default."
)
def settings_list(
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON array.")] = False,
) -> None:
    """List every setting: its PREFIXGATE_* variable, the value in effect here and where it
    comes from, its default and description."""
    try:
        docs, conflicts = setting_docs()
    except UnicodeDecodeError as error:
        env_file_unreadable(error)
    for reason in conflicts:
        typer.echo(f"prefixgate: warning: settings: {one_line(reason)}", err=True)
    if as_json:
        print_json([asdict(doc) for doc in docs])  # paths print as text
        return
    typer.echo("Every setting is an environment variable (or a line in .env in the working")
    typer.echo("directory); the variable wins over .env, and unset settings take the default.")
    typer.echo("Each shows the value in effect here and where it comes from (`serve` and")
    typer.echo("`worker` options override some); secrets show only whether they are set,")
    typer.echo("and URLs hide their passwords.\n")
    width = max(len(doc.env) for doc in docs)
    for doc in docs:
        value = (doc.value or UNSET) if doc.secret else env_text(doc.value)
        typer.echo(f"{doc.env:<{width}}  {value}  {origin_text(doc)}")
        if doc.error is not None:
            typer.echo(f"    refused: {doc.error}")
        for line in textwrap.wrap(doc.description, width=DESCRIPTION_WIDTH):
            typer.echo(f"    {line}")


class SettingOptionsCommand(TyperCommand):
    """A command whose options stand for settings: an option named after a setting, with no
    default of its own, shows in --help the default it has here (the setting's value in the
    environment or .env, else the setting's default) and where that comes from."""

    def format_options(self, ctx: Context, formatter: HelpFormatter) -> None:
        from gateway.settings import Settings

        try:
            given = given_values()
        except UnicodeDecodeError:  # help still answers; the command itself says what is wrong
            super().format_options(ctx, formatter)
            return
        helps = {param: param.help for param in self.params if isinstance(param, TyperOption)}
        try:
            for param, text in helps.items():
                field = Settings.model_fields.get(param.name or "")
                if field is None or param.default is not None or _is_secret(field):
                    continue
                if param.name in given:
                    value = given[param.name]
                    note: str | None = f"{shown(value.text, _is_list(field))}, from {value.source}"
                else:
                    default = _default(field, {})
                    note = env_text(default) if default not in (None, []) else None
                if note is not None:
                    param.help = f"{text}  [default: {note}]" if text else f"[default: {note}]"
            super().format_options(ctx, formatter)
        finally:
            for param, text in helps.items():
                param.help = text


def _source_key(variable: str) -> str:
    """A variable's name as pydantic-settings' sources key it (lower-case unless the settings
    are case-sensitive)."""
    from gateway.settings import Settings

    return variable if Settings.model_config.get("case_sensitive") else variable.lower()


def _env_files() -> list[Path]:
    """The .env files `Settings` reads that exist here, in the order they are read."""
    from gateway.settings import Settings

    configured = Settings.model_config.get("env_file")
    files = [configured] if isinstance(configured, str | os.PathLike) else list(configured or ())
    paths = [Path(file).expanduser() for file in files]
    return [path.absolute() for path in paths if path.is_file()]


def _printable(value: Any, field: FieldInfo) -> Any:
    """A secret only as whether it is set; anything else as `shown`."""
    if _is_secret(field):
        return None if value is None else HIDDEN
    return shown(value, _is_list(field))


def _refusals(error: ValidationError) -> dict[str, str]:
    """Why each refused setting is refused, by name ("" for a rule across settings)."""
    refused: dict[str, str] = {}
    for where, reason in setting_problems(error):
        refused.setdefault(where.split(".")[0], one_line(reason))
    return refused


def _default(field: FieldInfo, values: dict[str, Any]) -> Any:
    # Factories run as a fresh process would run them: `state_dir` follows $XDG_STATE_HOME.
    return field.get_default(call_default_factory=True, validated_data=values)


def _is_secret(field: FieldInfo) -> bool:
    from typing import get_args

    from pydantic import SecretStr

    return field.annotation is SecretStr or SecretStr in get_args(field.annotation)


def _is_list(field: FieldInfo) -> bool:
    from typing import get_origin

    return get_origin(field.annotation) is list


def _fields_only(settings: type[Settings]) -> type[Settings]:
    """`settings` without its rules across settings (its model validators): each value is
    still validated alone, so the others show while one of those rules refuses them."""
    rules = settings.__pydantic_decorators__.model_validators
    return type("FieldsOnly", (settings,), {name: lambda self: self for name in rules})
