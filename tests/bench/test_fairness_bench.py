"""`bench.fairness`: its accounting (service from /metrics or from usage, shares in a window,
latency percentiles), its goals, its plot, and one short run against real servers on a tiny
model (the numbers of such a run say nothing; its shape and its bookkeeping do)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.fairness import goals, main, share_goal
from bench.fairness_load import Answer
from bench.fairness_plot import plot_shares
from bench.fairness_service import (
    SERVICE_FAMILY,
    TOKENS_FAMILY,
    latency,
    metrics_series,
    parse_metrics,
    rate,
    served,
    share_timeline,
    shares,
    usage_series,
    value_at,
)

SCRAPE = f"""# HELP {SERVICE_FAMILY.removesuffix("_total")} Weighted tokens served.
# TYPE {SERVICE_FAMILY.removesuffix("_total")} counter
{SERVICE_FAMILY}{{tenant="heavy-a"}} 300.0
{SERVICE_FAMILY}{{tenant="0d3c6a52-6a8e-4d0b-9d53-6f1a4a0c0001"}} 100.0
{SERVICE_FAMILY}{{tenant="stranger"}} 999.0
# HELP {TOKENS_FAMILY.removesuffix("_total")} Tokens computed.
# TYPE {TOKENS_FAMILY.removesuffix("_total")} counter
{TOKENS_FAMILY}{{tenant="heavy-a",kind="prefill"}} 250.0
{TOKENS_FAMILY}{{tenant="heavy-a",kind="decode"}} 5.0
# HELP prefixgate_engine_steps Engine steps run.
# TYPE prefixgate_engine_steps counter
prefixgate_engine_steps_total 12.0
# HELP prefixgate_engine_step_seconds Time spent in engine steps.
# TYPE prefixgate_engine_step_seconds counter
prefixgate_engine_step_seconds_total 1.5
# HELP prefixgate_queue_depth Sequences in the engine.
# TYPE prefixgate_queue_depth gauge
prefixgate_queue_depth{{state="waiting"}} 2.0
prefixgate_queue_depth{{state="running"}} 3.0
# HELP prefixgate_engine_cpu_threads Threads.
# TYPE prefixgate_engine_cpu_threads gauge
prefixgate_engine_cpu_threads 1.0
"""


def answer(tenant: str, sent: float, done: float, tokens: int, status: int = 200) -> Answer:
    return Answer(tenant, sent, done, status, tokens - 1 if tokens else 0, min(tokens, 1), False)


def test_a_scrape_gives_service_and_tokens_per_tenant_label_queue_threads_and_steps() -> None:
    sample = parse_metrics(SCRAPE, at=7.0)
    assert sample.at == 7.0
    assert sample.service["heavy-a"] == 300.0
    assert sample.tokens == {"heavy-a": 255.0}  # prefill and decode together
    assert sample.queued == 5 and sample.threads == 1
    assert sample.steps == 12 and sample.step_seconds == 1.5
    # Labels become slugs: a tenant's id (before its first request) and its slug add up, and
    # a tenant the bench did not make is left out.
    slugs = {"heavy-a": "heavy-a", "0d3c6a52-6a8e-4d0b-9d53-6f1a4a0c0001": "heavy-a"}
    assert metrics_series([sample], slugs) == [(7.0, {"heavy-a": 400.0})]


def test_service_in_a_window_is_interpolated_between_samples() -> None:
    series = [(0.0, {"a": 0.0, "b": 0.0}), (2.0, {"a": 200.0, "b": 100.0}), (4.0, {"a": 200.0})]
    assert value_at(series, 1.0) == {"a": 100.0, "b": 50.0}
    assert value_at(series, -5.0) == {"a": 0.0, "b": 0.0}  # clamped to the first sample
    assert value_at(series, 9.0) == {"a": 200.0}  # and to the last
    assert served(series, 1.0, 2.0) == {"a": 100.0, "b": 50.0}
    assert shares(served(series, 0.0, 2.0), ("a", "b")) == {"a": 0.6667, "b": 0.3333}
    assert shares({}, ("a", "b")) == {"a": None, "b": None}  # nothing served: no share


def test_a_rate_counts_whole_steps_between_the_first_and_last_growth_in_a_window() -> None:
    # Steps end at 1, 3 and 5 s, each serving 100, sampled every half second.
    series = [(t / 2, {"a": 100.0 * ((t // 2 + 1) // 2 if t else 0)}) for t in range(12)]
    assert [point["a"] for _, point in series[:7]] == [0, 0, 100, 100, 100, 100, 200]
    # The window's edges (0.2 and 5.2) cut steps; only 1.0 -> 5.0 (200 in 4 s) counts.
    assert rate(series, "a", 0.2, 5.2) == pytest.approx(50.0)
    assert rate(series, "a", 0.2, 2.0) is None  # one step end alone gives no rate
    assert rate(series, "b", 0.0, 6.0) is None


def test_usage_is_spread_evenly_over_each_answers_span_and_refusals_count_nothing() -> None:
    answers = [answer("a", 0.0, 4.0, 400), answer("b", 2.0, 3.0, 50), answer("b", 0, 1, 0, 429)]
    series = usage_series(answers, [0.0, 1.0, 2.0, 3.0, 4.0])
    assert [point["a"] for _, point in series[1:]] == [100.0, 200.0, 300.0, 400.0]
    assert series[0][1] == {"a": 0.0, "b": 0.0}
    assert series[3][1]["b"] == 50.0 and series[2][1]["b"] == 0.0
    assert shares(served(series, 2.0, 3.0), ("a", "b")) == {"a": 0.6667, "b": 0.3333}


def test_the_timeline_gives_each_moments_share_over_the_seconds_before_it() -> None:
    # a is served 10 a second throughout, b 30 a second from t=2.
    series = [(float(t), {"a": 10.0 * t, "b": 30.0 * max(0, t - 2)}) for t in range(6)]
    timeline = share_timeline(series, ("a", "b"), start=1.0, end=5.0, window_s=1.0)
    assert timeline["t_s"] == [1.0, 2.0, 3.0, 4.0]  # from one window after the start
    assert timeline["shares"]["a"] == [1.0, 0.25, 0.25, 0.25]
    assert timeline["shares"]["b"] == [0.0, 0.75, 0.75, 0.75]


def test_latency_percentiles_are_of_answered_requests_and_every_status_is_counted() -> None:
    answers = [answer("b", 0.0, seconds / 10, 3) for seconds in range(1, 11)]
    answers.append(answer("b", 0.0, 99.0, 0, status=503))
    stats = latency(answers)
    assert stats["requests"] == 10
    assert stats["p50_ms"] == pytest.approx(500.0)  # nearest rank of 0.1 ... 1.0 s
    assert stats["p99_ms"] == pytest.approx(1000.0)
    assert stats["statuses"] == {"200": 10, "503": 1}
    assert latency([])["p50_ms"] is None


def test_the_light_goal_adds_one_target_step_to_twice_the_latency_alone() -> None:
    alone, flooded = {"p50_ms": 100.0}, {"p50_ms": 250.0}
    shares_: dict[str, dict[str, float | None]] = {
        "equal": {"heavy-a": 0.54},
        "weighted": {"heavy-a": 0.60},
    }
    met = goals(alone, flooded, 60.0, shares_, None)
    assert met["light_p50_under_flood"]["bound_ms"] == 260.0
    assert met["light_p50_under_flood"]["met"] is True
    assert met["equal_weights_share"]["met"] is True  # within 0.5 +/- 0.05
    assert met["weights_2_1_share"]["met"] is False  # 0.60 is not within 0.667 +/- 0.05
    # Without a target step from /readyz the bound is twice the latency alone, and says so.
    strict = goals(alone, flooded, None, shares_, None)["light_p50_under_flood"]
    assert strict["bound_ms"] == 200.0 and strict["met"] is False
    assert "no target step" in strict["bound"]
    # A weighted scenario the server refused is not run: no verdict, and the reason.
    refused = goals(alone, flooded, 60.0, {"equal": shares_["equal"]}, "HTTP 422")
    assert refused["weights_2_1_share"]["met"] is None
    assert refused["weights_2_1_share"]["not_run"] == "HTTP 422"


def test_a_share_goal_holds_within_its_tolerance_on_either_side() -> None:
    assert share_goal(0.549, 0.5)["met"] and share_goal(0.451, 0.5)["met"]
    assert not share_goal(0.56, 0.5)["met"] and not share_goal(0.44, 0.5)["met"]
    assert share_goal(None, 0.5)["met"] is None


def test_the_plot_is_written_with_a_panel_for_a_scenario_that_did_not_run(tmp_path: Path) -> None:
    timeline = {"t_s": [1.0, 2.0], "shares": {"heavy-a": [0.5, None], "heavy-c": [0.5, None]}}
    both = {
        "service_source": "usage",
        "light": {"alone": {"p50_ms": 50.0}, "under_flood": {"p50_ms": 80.0}},
        "timelines": {"mixed": timeline, "equal": timeline},
    }
    mixed_only = {**both, "timelines": {"mixed": timeline}}
    path = tmp_path / "fairness.png"
    plot_shares(str(path), {"modes": {"per_step": both, "fair": mixed_only}})
    assert path.read_bytes().startswith(b"\x89PNG")


@pytest.mark.slow
def test_a_short_run_measures_every_scenario_on_both_modes(
    tiny_chat_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "fairness.json"
    result = main(
        ["--quick", "--model", str(tiny_chat_dir), "--prompt-tokens", "256", "--seconds", "2",
         "--ramp", "0.5", "--light-interval", "0.2", "--out", str(out)]
    )  # fmt: skip
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert out.with_suffix(".png").read_bytes().startswith(b"\x89PNG")  # beside the JSON
    assert list(result["modes"]) == ["per_step", "fair"]
    for mode, numbers in result["modes"].items():
        assert numbers["service_source"] in ("metrics", "usage"), mode
        light = numbers["light"]
        assert light["alone"]["requests"] > 0 and light["under_flood"]["requests"] > 0, mode
        assert set(light["alone"]["statuses"]) == {"200"}, mode
        # heavy-a was served in its windows, and the flood's statuses are all answers.
        assert numbers["heavy"]["alone_tokens_per_s"] > 0, mode
        assert numbers["heavy"]["mixed_tokens_per_s"] > 0, mode
        for scenario, floods in numbers["floods"].items():
            for tenant, counts in floods.items():
                assert set(counts["statuses"]) <= {"200"}, (mode, scenario, tenant)
        for scenario, pair in numbers["shares"].items():
            if None not in pair.values():
                assert sum(pair.values()) == pytest.approx(1.0, abs=1e-3), (mode, scenario)
        checks = numbers["goals"]
        assert set(checks) == {
            "light_p50_under_flood", "equal_weights_share", "weights_2_1_share"
        }  # fmt: skip
        for name, check in checks.items():
            assert check["met"] in (True, False, None), (mode, name)
        if numbers["weights_error"] is None:  # the server took heavy-a's weight
            assert numbers["weights"] == {"heavy-a": 2.0, "heavy-c": 1.0}
            assert "weighted" in numbers["shares"]
