"""The sharing policy file: validated at start-up, with errors that name the field."""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

DEFAULT_POLICY_FILE = Path(__file__).with_name("default.yaml")


class PolicyFileError(Exception):
    """The policy file is missing, unreadable or invalid; the message names the field."""


class PolicyConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    min_public_blocks: int = Field(default=4, ge=1)
    allow_tenant_sharing: bool = True
    namespaces: tuple[str, ...] = Field(default=("default",), min_length=1)


def load_policy(path: Path | None = None) -> PolicyConfig:
    """Read and validate a policy file (default: policies/default.yaml)."""
    source = path or DEFAULT_POLICY_FILE
    try:
        data = yaml.safe_load(source.read_text(encoding="utf-8"))
    except OSError as error:
        raise PolicyFileError(f"policy file {source}: cannot read it ({error.strerror})") from None
    except yaml.YAMLError as error:
        raise PolicyFileError(f"policy file {source}: not valid YAML ({error})") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise PolicyFileError(f"policy file {source}: expected a mapping of settings")
    try:
        return PolicyConfig.model_validate(data)
    except ValidationError as error:
        first = error.errors()[0]
        field = ".".join(str(part) for part in first["loc"]) or "(top level)"
        raise PolicyFileError(f"policy file {source}: field `{field}`: {first['msg']}") from None
