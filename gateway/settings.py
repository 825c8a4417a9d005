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
from typing import Annotated, Any

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from tenancy.db import DEFAULT_DATABASE_URL
from tenancy.store import Store

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

    # Serving
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    model_dir: Path | None = None  # default: the embedded SmolLM2
    served_model_name: str | None = None  # default: the model directory's name
    block_size: int = Field(default=16, ge=1)
    kv_cache_bytes: int = Field(default=1 << 30, ge=1)
    max_num_seqs: int = Field(default=64, ge=1)
    max_num_batched_tokens: int = Field(default=2048, ge=1)
    queue_timeout_s: float = Field(default=30.0, gt=0)
    public_cache_blocks: int | None = None  # default: the whole pool
    enable_prefix_caching: bool = True

    # Limits
    max_body_bytes: int = Field(default=1 << 20, ge=1024)
    max_prompt_tokens: int | None = None  # default: the model's context length
    max_output_tokens: int = Field(default=4096, ge=1)
    request_timeout_s: float = Field(default=600.0, gt=0)
    shutdown_grace_s: float = Field(default=30.0, ge=0)
    # Bounded work before admission: checked before a chat template is rendered.
    max_messages: int = Field(default=1024, ge=1)
    max_prompt_chars: int | None = Field(default=None, ge=1)  # default: 16 x max_prompt_tokens
    prepare_concurrency: int = Field(default=2, ge=1)  # requests templated/tokenized at once

    # Connections: slow or unauthenticated clients cannot hold the server.
    header_read_timeout_s: float = Field(default=10.0, gt=0)
    body_read_timeout_s: float = Field(default=30.0, gt=0)
    max_pending_connections: int = Field(default=256, ge=1)  # not yet past their headers
    # Proxies whose X-Forwarded-For is believed (IPs or CIDRs); none by default.
    trusted_proxies: Annotated[list[str], NoDecode] = Field(default_factory=list)

    # Per-tenant metric series need `Authorization: Bearer <metrics_token>`.
    metrics_token: SecretStr | None = None

    # Auth and background work
    auth_cache_ttl_s: float = Field(default=30.0, ge=0)
    auth_stale_ttl_s: float = Field(default=300.0, ge=0)
    registry_refresh_s: float = Field(default=10.0, gt=0)
    tenancy_poll_s: float = Field(default=1.0, gt=0)  # how fast revocations and quotas apply
    audit_checkpoint_interval_s: float = Field(default=10.0, gt=0)

    # Observability
    otlp_endpoint: str | None = None  # e.g. http://collector:4318/v1/traces; off when unset

    @field_validator("trusted_proxies", mode="before")
    @classmethod
    def _comma_separated(cls, value: Any) -> Any:
        """`PREFIXGATE_TRUSTED_PROXIES=10.0.0.1,10.1.0.0/16` as well as a list."""
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

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

    def open_store(self, check_schema: bool = True) -> Store:
        """The tenancy store these settings describe (raises SchemaOutOfDate if behind)."""
        return Store.open(
            self.database_url,
            self.spool_path,
            self.secret("key_hash_secret"),
            self.secret("audit_signing_key"),
            self.audit_checkpoint_every,
            check_schema=check_schema,
        )

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
