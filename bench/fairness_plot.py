"""bench.fairness' plot: each tenant's share of service over time, one panel per scenario
(rows) and scheduling mode (columns), with the share each should get where the goal names one."""

from __future__ import annotations

import math
from typing import Any

SCENARIO_TITLES = {
    "mixed": "heavy flood + light trickle",
    "equal": "two floods, weights 1:1",
    "weighted": "two floods, weights 2:1",
}
GOAL_SHARES = {"equal": 0.5, "weighted": 2 / 3}  # the first tenant's share the goals name


def plot_shares(path: str, result: dict[str, Any]) -> None:
    """Draw the result's share timelines to a PNG file."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = result["modes"]
    rows = [name for name in SCENARIO_TITLES if any(name in m["timelines"] for m in modes.values())]
    figure, axes = plt.subplots(
        max(1, len(rows)), len(modes), figsize=(5 * len(modes), 2.6 * max(1, len(rows))),
        squeeze=False, sharey=True,
    )  # fmt: skip
    for column, (mode, numbers) in enumerate(modes.items()):
        for row, name in enumerate(rows):
            panel = axes[row][column]
            timeline = numbers["timelines"].get(name)
            title = f"{mode}: {SCENARIO_TITLES[name]}"
            if timeline is None:
                panel.set_title(f"{title} (not run)", fontsize=9)
                continue
            for tenant, values in timeline["shares"].items():
                # A gap where no step ended within the seconds before a moment.
                shares = [math.nan if value is None else value for value in values]
                panel.plot(timeline["t_s"], shares, label=tenant)
            if name in GOAL_SHARES:
                panel.axhline(GOAL_SHARES[name], color="grey", linestyle="--", linewidth=0.8)
            if name == "mixed":
                light = numbers["light"]
                title += (
                    f"\nlight p50 {light['alone']['p50_ms']} ms alone, "
                    f"{light['under_flood']['p50_ms']} ms in the flood"
                )
            panel.set_title(title, fontsize=9)
            panel.set_ylim(0, 1)
            panel.set_xlabel("s from the flood's start", fontsize=8)
            panel.set_ylabel(f"share ({numbers['service_source']})", fontsize=8)
            panel.legend(fontsize=7, loc="upper right")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
