"""How long a step will take: a cost model of this model on this machine, calibrated at start.

A step's time is predicted from what it computes:

    ms = (fixed + per_token x tokens + per_context x attended pairs) x threads factor

`tokens` are every position the step computes (prompt chunks and decodes alike: they go through
the same projections), `attended pairs` the (token, earlier position) pairs its attention reads
(a chunk of n tokens from position s attends n x s + n(n+1)/2 of them), and the threads factor
follows the CPU threads the step computes with now (Amdahl's law: a `serial_share` of the work
does not speed up with threads). `fixed` is what a step costs whatever it carries (reading the
weights, launching every layer).

`calibrate` fits the coefficients by timing a few steps of synthetic tokens on the engine's own
runner and pool before it serves (a decode, a prompt chunk at position 0, the same chunk further
in, and that chunk again on one thread), taking the fastest of five runs of each after a
warm-up (the fastest is the one least disturbed by whatever else ran). Fits are kept per
model, device, dtype, backend and thread count for the life of the process, so engines built
again (a restart, the tests) do not time the model again.

The calibration times the forward pass alone, once, and a busy machine can mislead it; a step
also samples and streams, and the machine's speed moves with what else runs on it. So the
engine refits the model from every step it runs (`CostFit`), starting from the calibration,
unless a cost model was given. The default step-time target is `TARGET_DECODE_STEPS` decode
steps at the fastest the engine has seen them (calibrated, or a settled fit's if faster): a
busy start does not make it long, and later contention makes each step's prediction longer,
so fewer tokens fit, not the target.

The scheduler uses it twice (engine/scheduler.py): to keep a step short while another tenant's
light work waits on it (`target_ms`), and to weigh each tenant's service (engine/fairness.py)
by what its tokens cost (`service`).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from engine.cache.block_pool import BlockPool
from engine.model.runner import Chunk, ModelRunner

logger = logging.getLogger(__name__)

# The least a token may cost in a fit (a noisy fit can find a slope of zero or below).
MIN_PER_TOKEN_MS = 1e-6

# The default step-time target, in predicted decode steps of one sequence: a step that carries
# another tenant's light work spends at least three quarters of its time on tokens.
TARGET_DECODE_STEPS = 4.0
# Tokens of the calibration's prompt chunks, and the position of the later one (both cut to
# the pool where it is smaller).
CALIBRATION_TOKENS = 128
CALIBRATION_OFFSET = 768
_REPEATS = 5


def attended_pairs(start: int, tokens: int) -> int:
    """(token, position) pairs the attention of `tokens` tokens from position `start` reads."""
    return tokens * start + tokens * (tokens + 1) // 2


@dataclass(frozen=True, slots=True)
class StepCost:
    """Predicted step time in milliseconds; see the module docstring for the model."""

    fixed_ms: float
    per_token_ms: float
    per_context_ms: float
    threads: int = 1  # the threads the coefficients were timed with
    serial_share: float = 1.0  # of the work, that does not speed up with more threads

    def __post_init__(self) -> None:
        if min(self.fixed_ms, self.per_context_ms) < 0 or self.per_token_ms <= 0:
            raise ValueError("step cost coefficients must be positive")
        if self.threads < 1 or not 0.0 <= self.serial_share <= 1.0:
            raise ValueError("threads must be positive and serial_share within [0, 1]")

    def thread_factor(self, threads: int) -> float:
        """How much longer a step takes on `threads` threads than on the calibrated count."""
        if threads >= self.threads:
            return 1.0
        share = self.serial_share
        return (share + (1.0 - share) / threads) / (share + (1.0 - share) / self.threads)

    def tokens_ms(self, tokens: int, pairs: int) -> float:
        """The part of a step's time that `tokens` tokens attending `pairs` pairs add, on the
        calibrated threads."""
        return self.per_token_ms * tokens + self.per_context_ms * pairs

    def predict_ms(self, tokens: int, pairs: int, threads: int) -> float:
        """A whole step's time: its fixed cost and its tokens, on `threads` threads."""
        return (self.fixed_ms + self.tokens_ms(tokens, pairs)) * self.thread_factor(threads)

    def fitting_tokens(self, budget_ms: float, start: int, threads: int, most: int) -> int:
        """Most tokens (up to `most`) of a chunk from position `start` that add at most
        `budget_ms` to a step on `threads` threads."""
        per_token = (self.per_token_ms + self.per_context_ms * (start + most)) * self.thread_factor(
            threads
        )
        if budget_ms <= 0:
            return 0
        return min(most, int(budget_ms / per_token))

    def service(self, start: int, tokens: int) -> float:
        """What a chunk costs, in tokens of a prompt chunk at position 0 (the unit of tenants'
        service counters): one for each such token, more for tokens that attend further."""
        return self.tokens_ms(tokens, attended_pairs(start, tokens)) / self.per_token_ms

    def default_target_ms(self) -> float:
        """`TARGET_DECODE_STEPS` predicted decode steps of one sequence, on the calibrated
        threads."""
        return TARGET_DECODE_STEPS * self.predict_ms(1, 1, self.threads)

    def describe(self) -> dict[str, float | int]:
        return {
            "fixed_ms": round(self.fixed_ms, 3),
            "per_token_ms": round(self.per_token_ms, 5),
            "per_context_ms": round(self.per_context_ms, 9),
            "calibrated_threads": self.threads,
            "serial_share": round(self.serial_share, 3),
        }


class CostFit:
    """The cost model followed from the steps the engine runs.

    Each step's observed time, brought back to the calibrated threads, is a sample of
    `fixed + per_token x tokens + per_context x pairs`; the model is the least-squares fit of
    the samples, each weighed `FORGET` times less than the one after it (about the last
    `1 / (1 - FORGET)` steps count), beside the calibration's three points, which always count
    as `PRIOR_STEPS` samples each (so that directions the steps do not vary in keep the
    calibration's slope). A fit made while the machine was busy, or a machine whose speed
    moves, is corrected within a few hundred steps. A model given in the config is used as is
    (`follow=False`).
    """

    FORGET = 0.995
    PRIOR_STEPS = 0.1
    SETTLED_STEPS = 100  # steps before a fit's decode step may lower the target
    # Features scaled to similar sizes (tokens in thousands, pairs in millions) for the solve.
    _SCALE = (1.0, 1e-3, 1e-6)

    def __init__(self, calibrated: StepCost, follow: bool = True) -> None:
        self.calibrated = calibrated
        self.follow = follow
        self.model = calibrated
        self.steps = 0
        # The fastest the engine has been seen to run a decode step of one sequence: the
        # calibration's, or a settled fit's if lower (a busy machine at start misleads the one,
        # a busy machine later the other; neither makes the target longer).
        self.fastest_decode_ms = calibrated.predict_ms(1, 1, calibrated.threads)
        self._xtx = np.zeros((3, 3))
        self._xty = np.zeros(3)
        self._prior_xtx = np.zeros((3, 3))
        self._prior_xty = np.zeros(3)
        for tokens, start in ((1, 0), (CALIBRATION_TOKENS, 0), (CALIBRATION_TOKENS, 512)):
            pairs = attended_pairs(start, tokens)
            x = self._features(tokens, pairs)
            y = calibrated.predict_ms(tokens, pairs, calibrated.threads)
            self._prior_xtx += self.PRIOR_STEPS * np.outer(x, x)
            self._prior_xty += self.PRIOR_STEPS * y * x

    def observe(self, tokens: int, pairs: int, threads: int, observed_ms: float) -> None:
        """A step of `tokens` tokens attending `pairs` pairs took `observed_ms` on `threads`."""
        if not self.follow or tokens <= 0 or not math.isfinite(observed_ms):
            return
        x = self._features(tokens, pairs)
        y = observed_ms / self.calibrated.thread_factor(threads)
        self._xtx = self.FORGET * self._xtx + np.outer(x, x)
        self._xty = self.FORGET * self._xty + y * x
        self.steps += 1
        try:
            fixed, per_token, per_context = np.linalg.solve(
                self._xtx + self._prior_xtx, self._xty + self._prior_xty
            ) * np.array(self._SCALE)
        except np.linalg.LinAlgError:  # pragma: no cover - the prior keeps it regular
            return
        self.model = StepCost(
            max(0.0, float(fixed)),
            max(MIN_PER_TOKEN_MS, float(per_token)),
            max(0.0, float(per_context)),
            self.calibrated.threads,
            self.calibrated.serial_share,
        )
        if self.steps >= self.SETTLED_STEPS:
            decode = self.model.predict_ms(1, 1, self.model.threads)
            self.fastest_decode_ms = min(self.fastest_decode_ms, decode)

    def target_ms(self) -> float:
        """The default step-time target: `TARGET_DECODE_STEPS` decode steps at the fastest."""
        return TARGET_DECODE_STEPS * self.fastest_decode_ms

    def _features(self, tokens: int, pairs: int) -> np.ndarray:
        scaled: np.ndarray = np.array([1.0, tokens, pairs]) * np.array(self._SCALE)
        return scaled


_fits: dict[tuple[object, ...], StepCost] = {}
_fits_lock = threading.Lock()


def calibrate(
    runner: ModelRunner, pool: BlockPool, key: tuple[object, ...], threads: int
) -> StepCost:
    """The cost model of `runner` (see the module docstring), timed with synthetic tokens in
    the first blocks of `pool` (zeroed afterwards) unless a fit under `key` is already known.

    Call it before the engine serves: it writes into the pool and runs the model.
    """
    with _fits_lock:
        known = _fits.get(key)
        if known is None:
            started = time.perf_counter()
            known = _fits[key] = _Calibration(runner, pool, threads).fit()
            logger.info(
                "engine: step cost calibrated in %.1f s: %s",
                time.perf_counter() - started,
                known.describe(),
            )
        return known


class _Calibration:
    def __init__(self, runner: ModelRunner, pool: BlockPool, threads: int) -> None:
        self.runner, self.pool, self.threads = runner, pool, threads
        self.kv = pool.kv
        capacity = pool.num_blocks * pool.spec.block_size
        self.tokens = max(2, min(CALIBRATION_TOKENS, capacity // 2))
        self.offset = max(0, min(CALIBRATION_OFFSET, capacity - self.tokens))
        self.blocks = list(range(-(-(self.offset + self.tokens) // pool.spec.block_size)))

    def fit(self) -> StepCost:
        computed = self.runner.computed_tokens
        try:
            self._time(1, 0)  # warm-up: first runs allocate
            self._time(self.tokens, 0)
            decode = self._fastest(1, 0)
            near = self._fastest(self.tokens, 0)
            far = self._fastest(self.tokens, self.offset)
            # Threads matter where they are CPU threads (the governor's).
            on_cpu = self.kv.device.type == "cpu" and self.threads > 1
            alone = self._fastest(self.tokens, 0, threads=1, runs=3) if on_cpu else near
        finally:
            self.runner.computed_tokens = computed
            blocks = torch.tensor(self.blocks, device=self.kv.device)
            self.pool.zero_blocks(self.kv, blocks)
        n = self.tokens
        extra_pairs = attended_pairs(self.offset, n) - attended_pairs(0, n)
        per_context = max(0.0, (far - near) / extra_pairs) if extra_pairs else 0.0
        pairs_grown = attended_pairs(0, n) - attended_pairs(0, 1)
        per_token = max(MIN_PER_TOKEN_MS, (near - decode - per_context * pairs_grown) / (n - 1))
        fixed = max(0.0, decode - per_token - per_context)
        return StepCost(fixed, per_token, per_context, self.threads, self._serial(near, alone))

    def _serial(self, all_threads_ms: float, one_thread_ms: float) -> float:
        """Amdahl's serial share from a step's time on all threads and on one."""
        if self.threads <= 1 or all_threads_ms <= 0:
            return 1.0
        inverse = 1.0 / self.threads
        share = (all_threads_ms / one_thread_ms - inverse) / (1.0 - inverse)
        return min(1.0, max(0.0, share))

    def _fastest(
        self, tokens: int, start: int, threads: int | None = None, runs: int = _REPEATS
    ) -> float:
        return min(self._time(tokens, start, threads) for _ in range(runs))

    def _time(self, tokens: int, start: int, threads: int | None = None) -> float:
        return synthetic_step_ms(self.runner, self.blocks, tokens, start, threads)


def synthetic_step_ms(
    runner: ModelRunner,
    block_ids: list[int],
    tokens: int,
    start: int,
    threads: int | None = None,
) -> float:
    """Milliseconds of one step computing `tokens` synthetic tokens from position `start` in
    `block_ids` (the caller's scratch blocks: it zeroes them), on `threads` CPU threads or as
    many as now."""
    chunk = Chunk(
        request_id="calibration",
        token_ids=[0] * tokens,
        start=start,
        block_ids=block_ids,
        prompt_positions=0,
        needs_logits=True,
    )
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        _synchronize(runner.device)
        started = time.perf_counter()
        runner.run([chunk])
        _synchronize(runner.device)
        return (time.perf_counter() - started) * 1000.0
    finally:
        torch.set_num_threads(before)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
