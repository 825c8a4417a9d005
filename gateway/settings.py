"""All of PrefixGate's settings in one pydantic-settings class (environment prefix PREFIXGATE_).

Secrets (the key-hashing secret, the audit signing key, the admin JWT secret) come from the
environment in production. When one is not set, a random value is generated once and kept in
`<state_dir>/secrets.json` (mode 0600), so a fresh `make run` is safe without configuration
and keeps working across restarts.
"""

from __future__ import annotations

import json
import os
import secrets
from functools import cached_property
from pathlib import Path

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from tenancy.db import DEFAULT_DATABASE_URL

_GENERATED_SECRETS = ("key_hash_secret", "audit_signing_key", "jwt_secret")


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="PREFIXGATE_", env_file=".env", env_file_encoding="utf-8", extra="ignore"
    )

    database_url: str = DEFAULT_DATABASE_URL
    state_dir: Path = Path(".prefixgate")
    key_hash_secret: SecretStr | None = None
    audit_signing_key: SecretStr | None = None
    jwt_secret: SecretStr | None = None
    audit_spool_path: Path | None = None
    audit_checkpoint_every: int = Field(default=100, ge=1)
    policy_file: Path | None = None

    def secret(self, name: str) -> str:
        """A configured secret, or the one generated for this state directory."""
        if name not in _GENERATED_SECRETS:
            raise KeyError(name)
        configured: SecretStr | None = getattr(self, name)
        if configured is not None and configured.get_secret_value():
            return configured.get_secret_value()
        return self._generated_secrets[name]

    @property
    def spool_path(self) -> Path:
        return self.audit_spool_path or self.state_dir / "audit.spool"

    @cached_property
    def _generated_secrets(self) -> dict[str, str]:
        path = self.state_dir / "secrets.json"
        stored: dict[str, str] = {}
        if path.exists():
            stored = json.loads(path.read_text())
        missing = [name for name in _GENERATED_SECRETS if not stored.get(name)]
        if missing:
            self.state_dir.mkdir(parents=True, exist_ok=True)
            for name in missing:
                stored[name] = secrets.token_urlsafe(32)
            temporary = path.with_suffix(".tmp")
            descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(descriptor, "w") as handle:
                json.dump(stored, handle)
            temporary.replace(path)
        return stored
