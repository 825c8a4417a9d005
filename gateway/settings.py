"""All of PrefixGate's settings in one pydantic-settings class (environment prefix PREFIXGATE_).

State belongs to the deployment, never to the working directory: `state_dir` defaults to
`$XDG_STATE_HOME/prefixgate` (else `~/.local/state/prefixgate`), and the embedded SQLite
database lives there too, so `make run` and the CLI agree from any directory.

Secrets (the key-hashing secret, the audit signing key, the admin JWT secret, the master key)
come from the environment in production. When one is not set, a random value is generated once
and kept in `<state_dir>/secrets.json` (mode 0600), so a fresh `make run` is safe without
configuration and keeps working across restarts. The database remembers a fingerprint of the
secrets it was set up with; `open_store` refuses a process whose secrets differ
(`SecretMismatch`).

The master key wraps every tenant's and public prefix's data key (tenancy/seal_keys.py), which
seal the blocks of the second KV tier. Only a process that makes or reads data keys needs it:
its fingerprint is checked (and recorded on first use) where the tier is on or the key is set,
so a CLI run from another state directory never records a master key nobody uses.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import re
import secrets
from datetime import timedelta
from functools import cached_property
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from tenancy.db import check_database_url
from tenancy.deployment import SecretMismatch, mismatched_secrets
from tenancy.login_failures import LoginDelays
from tenancy.private_paths import PRIVATE_FILE, private_directory
from tenancy.store import Store

_GENERATED_SECRETS = ("key_hash_secret", "audit_signing_key", "jwt_secret", "master_key")
# The secrets the store works with: keys hashed or checkpoints signed under another value
# would fail (401s, "forged" checkpoints), so the database holds their fingerprints.
STORE_SECRETS = ("key_hash_secret", "audit_signing_key")
# Data keys wrapped under another master key do not unwrap: checked like the store's secrets
# wherever data keys are made or read (`Settings.checked_secrets`).
MASTER_KEY = "master_key"
MASTER_KEY_BYTES = 32
MASTER_KEY_FORMAT = (
    "32 random bytes in URL-safe base64, 43 characters (make one with "
    "`python3 -c 'import secrets; print(secrets.token_urlsafe(32))'`)"
)


def master_key_bytes(text: str) -> bytes:
    """The 32 bytes a master key's text stands for (URL-safe base64, padded or not); a
    ValueError that never repeats the text otherwise."""
    unpadded = text.strip().rstrip("=")
    try:
        # validate=True: a character outside the alphabet is an error, not silently skipped.
        decoded = base64.b64decode(unpadded + "=" * (-len(unpadded) % 4), b"-_", validate=True)
    except (binascii.Error, ValueError):
        decoded = b""
    if len(decoded) != MASTER_KEY_BYTES or len(unpadded) != 43:
        raise ValueError(f"the master key must be {MASTER_KEY_FORMAT}")
    return decoded


def default_state_dir() -> Path:
    """`$XDG_STATE_HOME/prefixgate`, else `~/.local/state/prefixgate` (XDG base directories)."""
    configured = os.environ.get("XDG_STATE_HOME", "")
    # The XDG spec says a relative value is invalid and must be ignored.
    base = Path(configured) if os.path.isabs(configured) else Path.home() / ".local" / "state"
    return base / "prefixgate"


def _default_database_url(data: dict[str, Any]) -> str:
    state_dir = data.get("state_dir") or default_state_dir()
    return f"sqlite:///{state_dir / 'prefixgate.db'}"


# A query parameter whose value is a credential (redis-py takes `?password=`).
_CREDENTIAL_PARAMETER = re.compile(
    r"([?&;](?:password|passwd|pass|pwd|secret|token|key|auth)[^=&;#]*=)[^&;#]*", re.IGNORECASE
)


def without_credentials(text: str) -> str:
    """`text` as it may be shown: in a URL (a database's, Redis's, a worker's) everything
    between `://` and the last `@` becomes `user:***` (or `***`), and a credential in its
    query `***`.

    By the shape the clients read, not the URL standard's: SQLAlchemy and redis-py take a
    password with `/`, `#` or `?` in it, which `urlsplit` would cut short. Hiding too much (an
    `@` later in the URL) is the safe side."""
    scheme, separator, rest = text.partition("://")
    if not separator:
        return text
    if "@" in rest:
        user_info, _, host = rest.rpartition("@")
        user, colon, _ = user_info.partition(":")
        rest = f"{user}:***@{host}" if colon and "/" not in user else f"***@{host}"
    return f"{scheme}://" + _CREDENTIAL_PARAMETER.sub(r"\1***", rest)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="PREFIXGATE_",
        env_file=".env",
        env_file_encoding="utf-8",
        extra="ignore",
        use_attribute_docstrings=True,  # each field's docstring is its description
    )

    # Declared before database_url: the default database lives in the state directory.
    state_dir: Path = Field(default_factory=default_state_dir)
    """Where the default database, generated secrets and audit files live; default:
    $XDG_STATE_HOME/prefixgate, else ~/.local/state/prefixgate."""
    database_url: str = Field(default_factory=_default_database_url)
    """SQLAlchemy URL of the tenancy database; default: SQLite prefixgate.db in the state
    directory."""
    key_hash_secret: SecretStr | None = None
    """HMAC secret for stored API keys and audit user ids, the same on every replica; generated
    into secrets.json when unset."""
    audit_signing_key: SecretStr | None = None
    """Signs audit checkpoints and export trailers; generated into secrets.json when unset."""
    jwt_secret: SecretStr | None = None
    """Secret for admin session tokens; generated into secrets.json when unset."""
    master_key: SecretStr | None = None
    """Wraps each tenant's and public prefix's data key, which seal the second KV tier's
    blocks: 32 random bytes in URL-safe base64 (43 characters), the same on every replica, for
    good (data keys wrapped under another do not unwrap); generated into secrets.json when
    unset."""
    audit_spool_path: Path | None = None
    """Where audit events wait while the database is unreachable; default:
    <state_dir>/audit.spool."""
    audit_checkpoint_path: Path | None = None
    """Append-only file of signed audit checkpoints, outside the database; default:
    <state_dir>/audit-checkpoints.jsonl."""
    audit_checkpoint_every: int = Field(default=100, ge=1)
    """Sign an audit checkpoint after this many events."""
    policy_file: Path | None = None
    """Sharing policy YAML (minimum public length, tenant-wide sharing, namespaces); default:
    policies/default.yaml."""

    # Serving
    host: str = "127.0.0.1"
    """Interface to listen on."""
    port: int = Field(default=8000, ge=0, le=65535)
    """Port to listen on."""
    model_dir: Path | None = None
    """A local Hugging Face model directory; default: the embedded SmolLM2-135M-Instruct."""
    chat_template: Path | None = None
    """A Jinja chat template file that replaces the model's own (to render tools, say);
    default: the model's own (the embedded model's adds tools to SmolLM2's)."""
    served_model_name: str | None = None
    """The model id clients send; default: the model directory's name."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the model runs; auto: the first CUDA GPU if there is one, else the CPU."""
    dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """Weights and KV cache dtype; auto: bfloat16 on a CUDA GPU that has it and on a CPU that
    computes it natively (AVX512_BF16 or AMX), else float32. On a CPU with AVX2 only, bfloat16
    decodes about twice as fast as float32 and prefills as fast, at bf16's rounding."""
    attention_backend: Literal["auto", "cpu", "torch", "triton"] = "auto"
    """Paged attention: triton (Triton kernels, CUDA), cpu (C++ kernel reading KV blocks in
    place), torch (reference, gathers blocks); auto: triton on CUDA, else cpu where it builds,
    else torch."""
    block_size: int = Field(default=16, ge=1)
    """Tokens per KV block: the unit of caching, sharing and quotas."""
    kv_cache_bytes: int | None = Field(default=None, ge=1)
    """Memory for the KV block pool, in bytes; default: 1 GiB on a CPU, on CUDA what
    gpu_memory_fraction leaves."""
    gpu_memory_fraction: float = Field(default=0.9, gt=0, le=1)
    """On CUDA without kv_cache_bytes: the share of the GPU's memory the server may use; the KV
    pool gets what the weights and the largest step's activations leave of it."""
    max_num_seqs: int = Field(default=64, ge=1)
    """Most sequences running in one engine step."""
    max_num_batched_tokens: int = Field(default=2048, ge=1)
    """Most tokens computed in one engine step (the chunked-prefill budget)."""
    queue_timeout_s: float = Field(default=30.0, gt=0)
    """How long a request may wait for KV blocks before it fails."""
    scheduling: Literal["fair", "per_step"] = "fair"
    """fair: each tenant's service counted over time (weighted by its scheduling weight) and
    steps kept short while another tenant's light work waits on them; per_step: each step's
    budget split equally between the tenants with work, nothing remembered between steps (the
    earlier scheduling, for comparison)."""
    step_target_ms: float | None = Field(default=None, ge=1, le=60_000, allow_inf_nan=False)
    """Longest predicted time of a step that carries another tenant's light work (fair
    scheduling); default: four decode steps at the fastest the engine has seen them
    (calibrated at start, refitted from its steps; shown in /readyz)."""
    public_cache_blocks: int | None = None
    """Quota of the public budget, in blocks; default: the whole pool."""

    kv_eviction: Literal["value", "lru"] = "value"
    """Which idle cached KV block is evicted first, in the pool and in the tier: value (the
    least prefill time its reuse has saved per byte, aged) or lru (least recently used, for
    comparison)."""
    # The second KV tier: blocks that leave the pool, sealed per tenant (tenancy/seal_keys.py)
    kv_tier: Literal["off", "disk", "redis"] = "off"
    """Where KV blocks evicted from the pool live on: off, disk (a file per worker in
    kv_tier_dir) or redis (one store every worker shares, at kv_tier_redis_url). Each block is
    sealed (AES-256-GCM) under its tenant's or public prefix's data key, wrapped by
    master_key; deleting a tenant makes its blocks there unreadable at once."""
    kv_tier_dir: Path | None = None
    """Directory of the disk tier; default: <state_dir>/kv-tier."""
    kv_tier_capacity_bytes: int = Field(default=4 << 30, ge=1)
    """Most bytes the tier holds (per worker on disk; in all on Redis); default: 4 GiB."""
    kv_tier_redis_url: str | None = None
    """Redis of the redis tier (redis://[:password@]host:port/db, rediss:// for TLS); default:
    redis_url."""
    public_tier_quota_bytes: int | None = Field(default=None, ge=0)
    """Quota of the public budget in the tier, in bytes; default: the public pool budget's
    bytes (public_cache_blocks x the bytes of a block). A tenant's own tier quota is set per
    tenant (default: its pool quota's bytes)."""
    enable_prefix_caching: bool = True
    """Reuse cached prefixes; false computes every prompt in full."""

    drop_unknown_params: bool = False
    """Drop request fields PrefixGate does not know (logged once per field) instead of
    answering 400 naming them."""

    # Limits
    max_body_bytes: int = Field(default=1 << 20, ge=1024)
    """Largest request body; a larger one is a 413."""
    max_prompt_tokens: int | None = None
    """Longest prompt, in tokens; default: the model's context length."""
    max_output_tokens: int = Field(default=4096, ge=1)
    """Largest max_tokens a request may ask for."""
    max_choices: int = Field(default=8, ge=1, le=128)
    """Largest n (choices per request); the choices share the prompt's KV."""
    request_timeout_s: float = Field(default=600.0, gt=0)
    """A request still running after this long is answered 504 and cancelled."""
    shutdown_grace_s: float = Field(default=30.0, ge=0)
    """On SIGTERM, how long in-flight requests may take to finish."""
    # Bounded work before admission: checked before a chat template is rendered.
    max_messages: int = Field(default=1024, ge=1)
    """Most messages in one chat request, checked before templating."""
    max_prompt_chars: int | None = Field(default=None, ge=1)
    """Most prompt characters, checked before templating; default: 16 x max_prompt_tokens."""
    prepare_concurrency: int = Field(default=2, ge=1)
    """Requests parsed, templated and tokenized at once."""

    # Connections: slow or unauthenticated clients cannot hold the server.
    header_read_timeout_s: float = Field(default=10.0, gt=0)
    """Time a client has to send its request headers."""
    body_read_timeout_s: float = Field(default=30.0, gt=0)
    """A request body that stalls this long is answered 408."""
    max_pending_connections: int = Field(default=256, ge=1)
    """Most connections still sending their headers; the next one gets a 503."""
    trusted_proxies: Annotated[list[str], NoDecode] = Field(default_factory=list)
    """Proxies (IPs or CIDRs, comma-separated) whose X-Forwarded-For is believed."""

    # Limits shared by every gateway
    redis_url: str | None = None
    """Redis (redis://[:password@]host:port/db, rediss:// for TLS) where every gateway keeps
    each tenant's requests, tokens and concurrency slots, so a tenant's limits hold once
    however many gateways serve it; unset: each gateway limits in its own memory."""
    redis_key_prefix: str = Field(default="prefixgate", min_length=1, max_length=64)
    """Prefix of every Redis key this deployment writes (two deployments on one Redis need
    different ones)."""
    redis_timeout_s: float = Field(default=0.25, gt=0, le=5)
    """A Redis call that takes longer has failed: limits fall back to this process until Redis
    answers again (fail-open)."""
    limit_lease_s: float = Field(default=15.0, ge=1, le=30)
    """How long a concurrency slot in Redis outlives the gateway that took it: running requests
    renew theirs every third of this, so a gateway that dies gives its slots back within it."""

    metrics_token: SecretStr | None = None
    """Per-tenant series on /metrics need `Authorization: Bearer <metrics_token>`."""

    # Auth and background work
    auth_cache_ttl_s: float = Field(default=30.0, ge=0)
    """How long a verified API key is remembered."""
    auth_stale_ttl_s: float = Field(default=300.0, ge=0)
    """While the database is unreachable, how long a key verified earlier keeps working."""
    registry_refresh_s: float = Field(default=2.0, gt=0)
    """How often the public-prefix registry is reloaded."""
    tenancy_poll_s: float = Field(default=1.0, gt=0)
    """How often tenancy changes (revoked keys, quotas, limits) are polled."""
    audit_checkpoint_interval_s: float = Field(default=10.0, gt=0)
    """Sign a checkpoint at least this often while audit events arrive."""

    # Admin API and console
    admin_token_ttl_s: int = Field(default=900, ge=60, le=86_400)
    """Lifetime of an admin session token (JWT) issued at login."""
    admin_token_leeway_s: int = Field(default=10, ge=0, le=300)
    """Clock skew allowed when checking an admin token's times."""
    admin_token_issuer: str = "prefixgate"
    """The `iss` claim admin tokens carry and must carry."""
    admin_login_attempts_per_minute: int = Field(default=10, ge=1)
    """Operator login attempts allowed per client address each minute, whatever the names
    (against password spraying); counted by each gateway."""
    admin_login_free_failures: int = Field(default=5, ge=1)
    """Failed logins of one (username, client address) pair before each further attempt of
    that pair must wait; no account is ever locked, other addresses are not slowed."""
    admin_login_max_delay_s: int = Field(default=900, ge=1, le=86_400)
    """Longest wait between attempts of one (username, client address) pair: the wait doubles
    with each failure past admin_login_free_failures (1 s, 2 s, 4 s, ...) up to this."""
    admin_totp_required: bool = False
    """Operators with the `admin` role must log in with a TOTP code: an admin without one
    enrolled is refused until it enrols (`prefixgate admins enrol-totp NAME` on the host)."""
    admin_changes_per_minute: int = Field(default=120, ge=1)
    """Changes one administrator (operator or tenant-admin key) may make each minute."""
    usage_sample_s: float = Field(default=2.0, gt=0)
    """How often live cache usage is sampled for the console."""
    usage_window_s: float = Field(default=900.0, gt=0)
    """How much live cache usage history is kept in memory."""

    # Scale-out: engine workers behind this gateway
    workers: Annotated[list[str], NoDecode] = Field(default_factory=list)
    """Engine workers to route to instead of running the engine in this process: https://host:port
    URLs, comma-separated, or dns://NAME:PORT (every address NAME resolves to, such as a
    Kubernetes headless Service, re-resolved every worker_poll_s), dialled over mutual TLS
    (http:// only with worker_plaintext)."""
    worker_secret: SecretStr | None = None
    """Shared secret between gateways and workers (at least 16 characters); `prefixgate worker`
    and a gateway with `workers` both need it."""
    worker_signing_key: SecretStr | None = None
    """Key (at least 32 characters) every gateway signs each request's cache scopes and token
    ids with (HMAC-SHA256) and every worker checks them with: a worker refuses a request whose
    signature does not match, so the worker secret alone cannot ask for another tenant's
    cache. `prefixgate worker` and a gateway with `workers` both need it."""
    worker_tls_cert: Path | None = None
    """This process's certificate (PEM) for traffic between gateways and workers: a worker's
    server certificate, a gateway's client certificate (`prefixgate certs issue`)."""
    worker_tls_key: Path | None = None
    """The private key (PEM) of worker_tls_cert."""
    worker_tls_ca: Path | None = None
    """The certificate (PEM) of the private CA that signs every gateway's and worker's
    certificate (`prefixgate certs init`): a worker accepts only clients it signed, a gateway
    only workers it signed."""
    worker_plaintext: bool = False
    """Allow plain HTTP between gateways and workers, without certificates: prompts then
    travel unencrypted and any holder of the worker secret and signing key is a client. For one
    machine or a test only; a worker or gateway without worker_tls_* refuses to start
    otherwise."""
    worker_poll_s: float = Field(default=1.0, gt=0)
    """How often a gateway reads each worker's cached block keys and load."""
    worker_timeout_s: float = Field(default=5.0, gt=0)
    """A worker that does not accept a connection or answer a poll within this long is out of
    routing until it answers again (the streams waiting on one that answers nothing end)."""
    worker_start_timeout_s: float = Field(default=300.0, gt=0)
    """How long a starting gateway waits for its first worker to answer."""
    routing: Literal["cache_aware", "round_robin"] = "cache_aware"
    """How a request picks its worker: cache_aware (the longest cached prefix under the
    request's own scopes, against load) or round_robin."""
    routing_load_tokens: int = Field(default=64, ge=0)
    """Cache-aware routing: what one request already in flight on a worker costs, in prompt
    tokens to compute (an engine batches, so one more request delays others little)."""
    routing_max_imbalance: int = Field(default=8, ge=1)
    """Cache-aware routing gives up cached tokens for the least loaded worker when the best
    one has this many more requests in flight."""

    # Structured outputs
    grammar_compile_timeout_s: float = Field(default=2.0, gt=0, le=60, allow_inf_nan=False)
    """Longest one structured-output grammar may take to compile; its compile runs in a
    separate process that is killed at the limit, and the request gets a 400."""
    grammar_compile_memory_mb: int = Field(default=1024, ge=128, le=65_536)
    """Most memory one grammar compile's process may take (its address space); past it the
    compile fails and the request gets a 400."""
    grammar_compile_processes: int = Field(default=2, ge=1, le=16)
    """Grammar compiles at once, each in its own process; a request waits briefly for one, then
    gets a 503 to retry."""

    # Observability
    otlp_endpoint: str | None = None
    """OTLP/HTTP endpoint for traces (e.g. http://collector:4318/v1/traces); off when unset."""

    @field_validator("state_dir")
    @classmethod
    def _absolute(cls, value: Path) -> Path:
        """`~` expanded and made absolute once, so messages name the real place."""
        return value.expanduser().absolute()

    @field_validator("database_url")
    @classmethod
    def _usable_database(cls, value: str) -> str:
        return check_database_url(value)

    @field_validator("trusted_proxies", "workers", mode="before")
    @classmethod
    def _comma_separated(cls, value: Any) -> Any:
        """`PREFIXGATE_TRUSTED_PROXIES=10.0.0.1,10.1.0.0/16` as well as a list."""
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("redis_url", "kv_tier_redis_url")
    @classmethod
    def _redis_scheme(cls, value: str | None) -> str | None:
        if value is not None and urlsplit(value).scheme not in ("redis", "rediss", "unix"):
            raise ValueError("expected redis://host:port/db, rediss://... or unix:///path")
        return value

    @field_validator("worker_secret")
    @classmethod
    def _long_enough(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and len(value.get_secret_value()) < 16:
            raise ValueError("the worker secret must be at least 16 characters")
        return value

    @field_validator("worker_signing_key")
    @classmethod
    def _signing_key_long_enough(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and len(value.get_secret_value()) < 32:
            raise ValueError("the worker signing key must be at least 32 characters")
        return value

    @field_validator("master_key")
    @classmethod
    def _master_key_format(cls, value: SecretStr | None) -> SecretStr | None:
        """Kept in one spelling (unpadded), so its fingerprint does not depend on padding."""
        if value is None:
            return None
        decoded = master_key_bytes(value.get_secret_value())
        return SecretStr(base64.urlsafe_b64encode(decoded).decode().rstrip("="))

    @model_validator(mode="after")
    def _tier_store_named(self) -> Settings:
        """The redis tier needs a Redis: its own URL or the gateway's."""
        if self.kv_tier == "redis" and self.tier_redis_url is None:
            raise ValueError(
                "kv_tier redis needs a Redis: set PREFIXGATE_KV_TIER_REDIS_URL or "
                "PREFIXGATE_REDIS_URL"
            )
        return self

    @model_validator(mode="after")
    def _worker_tls_complete(self) -> Settings:
        """worker_tls_cert, worker_tls_key and worker_tls_ca come together or not at all."""
        given = [
            name
            for name in ("worker_tls_cert", "worker_tls_key", "worker_tls_ca")
            if getattr(self, name) is not None
        ]
        if given and len(given) != 3:
            missing = sorted({"worker_tls_cert", "worker_tls_key", "worker_tls_ca"} - set(given))
            raise ValueError(
                "worker TLS needs a certificate, its key and the CA together: set "
                + " and ".join(f"PREFIXGATE_{name.upper()}" for name in missing)
            )
        return self

    def admin_login_delays(self) -> LoginDelays:
        """The delays between failed operator logins of one (name, source) pair."""
        return LoginDelays(
            self.admin_login_free_failures, timedelta(seconds=self.admin_login_max_delay_s)
        )

    def secret(self, name: str) -> str:
        """A configured secret, or the one generated for this state directory."""
        if name not in _GENERATED_SECRETS:
            raise KeyError(name)
        return self._configured(name) or self._generated_secrets[name]

    def _configured(self, name: str) -> str | None:
        configured: SecretStr | None = getattr(self, name)
        return configured.get_secret_value() if configured is not None else None

    def master_key_bytes(self) -> bytes:
        """The deployment's master key (configured, else generated for this state directory)
        as the 32 bytes that wrap data keys; ValueError if secrets.json holds a bad one."""
        return master_key_bytes(self.secret(MASTER_KEY))

    @property
    def uses_master_key(self) -> bool:
        """Whether this process makes or reads data keys (the tier is on), or was given a
        master key to check against the database's."""
        return self.kv_tier != "off" or self.master_key is not None

    def checked_secrets(self) -> tuple[str, ...]:
        """The secrets `open_store` holds against the database's fingerprints."""
        return (*STORE_SECRETS, MASTER_KEY) if self.uses_master_key else STORE_SECRETS

    @property
    def tier_dir(self) -> Path:
        """Where the disk tier keeps its files."""
        return self.kv_tier_dir or self.state_dir / "kv-tier"

    @property
    def tier_redis_url(self) -> str | None:
        """The Redis of the redis tier: its own URL, else the gateway's (None: neither)."""
        return self.kv_tier_redis_url or self.redis_url

    @property
    def spool_path(self) -> Path:
        return self.audit_spool_path or self.state_dir / "audit.spool"

    @property
    def checkpoint_path(self) -> Path:
        """The append-only file that keeps signed audit checkpoints outside the database."""
        return self.audit_checkpoint_path or self.state_dir / "audit-checkpoints.jsonl"

    def open_store(self, check_schema: bool = True) -> Store:
        """The tenancy store these settings describe, opened the same way by every process.

        Raises SchemaOutOfDate if the schema is behind, and SecretMismatch (one line naming
        the secret and the fix) if this process's secrets are not the deployment's.
        """
        store = Store.open(
            self.database_url,
            self.spool_path,
            self.secret("key_hash_secret"),
            self.secret("audit_signing_key"),
            self.audit_checkpoint_every,
            check_schema=check_schema,
            checkpoint_path=self.checkpoint_path,
        )
        if not check_schema:  # an older schema may not hold fingerprints yet
            return store
        try:
            differ = mismatched_secrets(
                store.sessions, {name: self.secret(name) for name in self.checked_secrets()}
            )
        except BaseException:
            store.close()
            raise
        if differ:
            store.close()
            raise SecretMismatch(self._mismatch_message(differ), differ)
        return store

    def _mismatch_message(self, differ: list[str]) -> str:
        names = " and ".join(differ)
        variables = " and ".join(f"PREFIXGATE_{name.upper()}" for name in differ)
        generated = not all(self._configured(name) for name in differ)
        source = f"from {self.state_dir / 'secrets.json'}" if generated else "from settings"
        verb, pronoun = (
            ("is not the one", "it") if len(differ) == 1 else ("are not the ones", "them")
        )
        return (
            f"{names} {verb} this database was set up with (this process read {pronoun} {source}): "
            f"set {variables} to the deployment's, or PREFIXGATE_STATE_DIR to its state directory"
        )

    @cached_property
    def _generated_secrets(self) -> dict[str, str]:
        path = self.state_dir / "secrets.json"
        stored: dict[str, str] = {}
        if path.exists():
            stored = json.loads(path.read_text())
        missing = [name for name in _GENERATED_SECRETS if not stored.get(name)]
        if missing:
            private_directory(self.state_dir)
            for name in missing:
                stored[name] = secrets.token_urlsafe(32)
            temporary = path.with_suffix(".tmp")
            descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_FILE)
            with os.fdopen(descriptor, "w") as handle:
                json.dump(stored, handle)
            temporary.replace(path)
        return stored
