"""Model loading, fingerprints, and the embedded SmolLM2 answering for real."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.model.loader import LoadedModel, ModelLoadError, fingerprint, load_model
from engine.sampling.sampler import SamplingParams
from policies.templates import render
from tests.support.models import make_request, run_one, tiny_model


def save_tiny(directory: Path, architecture: str, seed: int) -> Path:
    tiny_model(architecture, seed).save_pretrained(directory)
    return directory


def test_different_checkpoints_never_share_a_fingerprint(tmp_path: Path) -> None:
    first = save_tiny(tmp_path / "a", "llama", seed=0)
    second = save_tiny(tmp_path / "b", "llama", seed=1)
    same_again = save_tiny(tmp_path / "c", "llama", seed=0)
    assert fingerprint(first) != fingerprint(second)
    assert fingerprint(first) == fingerprint(same_again)
    assert fingerprint(first) != fingerprint(first, adapter_id="lora-1")


def test_fingerprint_follows_changed_files(tmp_path: Path) -> None:
    directory = save_tiny(tmp_path / "m", "qwen2", seed=0)
    before = fingerprint(directory)
    assert fingerprint(directory) == before  # remembered, same answer
    config = directory / "config.json"
    config.write_text(config.read_text().replace('"rms_norm_eps"', '"rms_norm_eps" ', 1))
    assert fingerprint(directory) != before


def test_loading_a_directory_that_is_not_a_model_fails_clearly(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        load_model(tmp_path)


def test_loaded_tiny_model_reports_its_shape(tmp_path: Path) -> None:
    loaded = load_model(save_tiny(tmp_path / "mistral-tiny", "mistral", seed=0))
    assert (loaded.name, loaded.num_layers, loaded.num_kv_heads, loaded.head_dim) == (
        "mistral-tiny",
        2,
        2,
        16,
    )
    assert loaded.tokenizer is None


def france_prompt(smollm2: LoadedModel) -> list[int]:
    question = [{"role": "user", "content": "What is the capital of France?"}]
    return render(smollm2.tokenizer, question, generation_prompt=True)


def test_smollm2_answers_the_capital_of_france(smollm2: LoadedModel) -> None:
    engine = Engine(smollm2, EngineConfig(num_blocks=256))
    sampling = SamplingParams(32, 0.0)
    result = run_one(engine, make_request("paris", france_prompt(smollm2), sampling=sampling))
    assert "Paris" in result.text
    assert result.deltas[-1].finish_reason == "stop"  # ended on <|im_end|> from the config


def test_smollm2_stop_string_cuts_the_answer(smollm2: LoadedModel) -> None:
    engine = Engine(smollm2, EngineConfig(num_blocks=256))
    sampling = SamplingParams(32, 0.0, stop=("Paris",))
    result = run_one(engine, make_request("cut", france_prompt(smollm2), sampling=sampling))
    assert result.deltas[-1].finish_reason == "stop"
    assert "Paris" not in result.text and result.text.startswith("The capital")


def test_the_embedded_model_renders_tools_and_a_given_template_replaces_the_models_own(
    smollm2_dir: Path, tmp_path: Path
) -> None:
    from gateway.openai.tool_calls import template_supports_tools
    from gateway.runtime.engine_setup import load_configured_model
    from gateway.settings import Settings

    embedded = load_configured_model(Settings())
    assert template_supports_tools(embedded.tokenizer)
    own = load_model(smollm2_dir)  # the directory as it is: SmolLM2's own template
    assert not template_supports_tools(own.tokenizer)
    conversation = [{"role": "user", "content": "hi"}]
    # Without tools, the embedded template renders exactly as SmolLM2's own.
    assert render(embedded.tokenizer, conversation, True) == render(
        own.tokenizer, conversation, True
    )
    given = tmp_path / "plain.jinja"
    given.write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    replaced = load_configured_model(Settings(model_dir=smollm2_dir, chat_template=given))
    assert replaced.tokenizer.apply_chat_template(conversation, tokenize=False) == "[hi]"
    with pytest.raises(ModelLoadError, match="cannot read the chat template"):
        load_configured_model(
            Settings(model_dir=smollm2_dir, chat_template=tmp_path / "missing.jinja")
        )
