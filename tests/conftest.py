"""Fixtures shared by every test package."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine.model_loader import LoadedModel, embedded_model_dir, load_model


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The embedded SmolLM2 model as a safetensors directory (converted once per machine)."""
    return embedded_model_dir()


@pytest.fixture(scope="session")
def smollm2(smollm2_dir: Path) -> LoadedModel:
    return load_model(smollm2_dir)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2: LoadedModel) -> Any:
    return smollm2.tokenizer
