"""The step cost model (engine/step_cost.py): predictions, the fit and the observed scale."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.model.runner import Chunk
from engine.step_cost import CostFit, StepCost, attended_pairs, calibrate
from tests.support.models import engine_for, loaded, tiny_model


def test_prediction_adds_tokens_and_attention_to_the_fixed_cost() -> None:
    cost = StepCost(fixed_ms=10.0, per_token_ms=0.5, per_context_ms=0.001)
    assert attended_pairs(0, 4) == 10 and attended_pairs(100, 1) == 101
    assert cost.predict_ms(4, 10, threads=1) == pytest.approx(10 + 2 + 0.01)
    assert cost.service(0, 4) == pytest.approx(4 + 0.001 * 10 / 0.5)  # prompt-token units
    assert cost.default_target_ms() == pytest.approx(4 * (10 + 0.5 + 0.001))


def test_fewer_threads_predict_longer_steps_by_amdahls_law() -> None:
    parallel = StepCost(fixed_ms=1.0, per_token_ms=1.0, per_context_ms=0.0, threads=4)
    assert parallel.thread_factor(4) == 1.0
    serial_free = StepCost(1.0, 1.0, 0.0, threads=4, serial_share=0.0)
    assert serial_free.thread_factor(1) == pytest.approx(4.0)
    assert serial_free.thread_factor(2) == pytest.approx(2.0)
    half = StepCost(1.0, 1.0, 0.0, threads=2, serial_share=0.5)
    assert half.thread_factor(1) == pytest.approx(1.0 / 0.75)


def test_fitting_tokens_stay_within_the_time_given() -> None:
    cost = StepCost(fixed_ms=2.0, per_token_ms=0.05, per_context_ms=0.0001, threads=2)
    fitted = cost.fitting_tokens(10.0, start=300, threads=1, most=10_000)
    assert 0 < fitted < 10_000
    added = cost.tokens_ms(fitted, attended_pairs(300, fitted)) * cost.thread_factor(1)
    assert added <= 10.0
    assert cost.fitting_tokens(10.0, start=0, threads=2, most=5) == 5
    assert cost.fitting_tokens(-1.0, start=0, threads=2, most=5) == 0


def test_bad_coefficients_are_refused() -> None:
    with pytest.raises(ValueError):
        StepCost(fixed_ms=1.0, per_token_ms=0.0, per_context_ms=0.0)
    with pytest.raises(ValueError):
        StepCost(fixed_ms=1.0, per_token_ms=1.0, per_context_ms=0.0, serial_share=1.5)


def test_the_fit_follows_the_steps_the_engine_runs() -> None:
    # A calibration taken on a busy machine: everything several times too slow.
    misled = StepCost(fixed_ms=240.0, per_token_ms=2.0, per_context_ms=0.001, threads=2)
    real = StepCost(fixed_ms=14.0, per_token_ms=0.5, per_context_ms=0.0002, threads=2)
    fit = CostFit(misled)
    assert fit.model is misled  # before any step
    steps = [(1, 200), (4, 3000), (16, 9000), (300, 60_000), (512, 400_000), (64, 30_000)]
    for _ in range(200):
        for tokens, pairs in steps:
            fit.observe(tokens, pairs, threads=2, observed_ms=real.predict_ms(tokens, pairs, 2))
    assert fit.model.fixed_ms == pytest.approx(real.fixed_ms, rel=0.1)
    assert fit.model.per_token_ms == pytest.approx(real.per_token_ms, rel=0.1)
    assert fit.target_ms() == pytest.approx(real.default_target_ms(), rel=0.1)
    # Later contention slows every step: the fit follows, the target does not grow.
    for _ in range(200):
        for tokens, pairs in steps:
            slow = 3 * real.predict_ms(tokens, pairs, 2)
            fit.observe(tokens, pairs, threads=2, observed_ms=slow)
    assert fit.model.fixed_ms == pytest.approx(3 * real.fixed_ms, rel=0.1)
    assert fit.target_ms() == pytest.approx(real.default_target_ms(), rel=0.1)


def test_a_step_on_fewer_threads_is_brought_back_to_the_calibrated_threads() -> None:
    calibrated = StepCost(10.0, 1.0, 0.0, threads=2, serial_share=0.0)
    fit = CostFit(calibrated)
    for _ in range(300):
        for tokens in (1, 50, 200):  # twice the time on one thread of two: as calibrated
            fit.observe(tokens, 0, threads=1, observed_ms=2 * calibrated.predict_ms(tokens, 0, 2))
    assert fit.model.per_token_ms == pytest.approx(1.0, rel=0.05)


def test_a_given_model_is_used_as_is() -> None:
    given = StepCost(fixed_ms=2.0, per_token_ms=0.05, per_context_ms=0.0)
    fit = CostFit(given, follow=False)
    fit.observe(100, 5000, threads=1, observed_ms=900.0)
    assert fit.model is given and fit.steps == 0


def test_calibration_times_the_model_once_per_set_up_and_leaves_the_pool_zeroed() -> None:
    model = loaded(tiny_model("llama", seed=7), "llama")
    engine = Engine(model, EngineConfig(block_size=16, num_blocks=128))
    cost = engine.step_cost
    assert cost is engine.cost_fit.calibrated  # no step has run yet
    assert cost.per_token_ms > 0 and cost.fixed_ms >= 0 and cost.per_context_ms >= 0
    assert 0.0 <= cost.serial_share <= 1.0
    assert not engine.pool.kv.any()  # the synthetic tokens' KV is gone
    runs: list[list[Chunk]] = []
    run = engine.runner.run

    def counting(chunks: list[Chunk]) -> torch.Tensor:
        runs.append(chunks)
        return run(chunks)

    engine.runner.run = counting  # type: ignore[method-assign]
    key = ("same set-up", 1)
    first = calibrate(engine.runner, engine.pool, key, threads=1)
    timed = len(runs)
    assert timed > 0 and calibrate(engine.runner, engine.pool, key, threads=1) is first
    assert len(runs) == timed  # known: not timed again
    described = engine.describe()["step_cost"]
    assert described["target_ms"] == pytest.approx(cost.default_target_ms(), rel=1e-3)


def test_a_target_given_in_the_config_is_used() -> None:
    engine = engine_for("llama", step_target_ms=25.0)
    assert engine.step_target_ms == 25.0
    assert engine.describe()["step_cost"]["target_ms"] == 25.0
