"""bench.replicas' arithmetic: what it counts as admitted in a minute, and as open at once."""

from __future__ import annotations

from bench.replicas import goal, most_at_once, most_in_a_window


def test_a_request_counts_in_a_window_only_when_sent_and_answered_inside_it() -> None:
    # The third was sent inside the first minute but answered after it: the limiter may have
    # admitted it in the next one, so no window holds all three.
    events = [(0.0, 0.1, 1), (10.0, 10.2, 1), (59.5, 60.5, 1), (70.5, 70.6, 1)]
    assert most_in_a_window(events) == 2
    assert most_in_a_window([*events, (65.0, 65.1, 1)]) == 3  # 10, 59.5 and 65 within [10, 70)
    assert most_in_a_window([(0.0, 0.1, 40), (30.0, 30.1, 25)]) == 65  # amounts, summed
    assert most_in_a_window([(0.0, 0.1, 40), (60.0, 60.1, 25)]) == 40  # a minute apart
    assert most_in_a_window([]) == 0


def test_streams_open_at_once_are_counted_from_their_overlaps() -> None:
    assert most_at_once([(0, 2), (1, 3), (2.5, 4), (5, 6)]) == 2
    assert most_at_once([(0, 10), (1, 9), (2, 8), (3, 7)]) == 4
    assert most_at_once([]) == 0


def test_a_goal_is_met_only_by_a_value_within_it() -> None:
    assert goal(0.5, 1.0)["met"] and not goal(1.5, 1.0)["met"]
    assert not goal(None, 1.0)["met"]  # nothing measured meets nothing
