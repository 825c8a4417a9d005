"""Each tenant's service counted over time: virtual token counters, weighted by tenant.

Every tenant with work has a counter of the service it has had, in prefill-token units
(`StepCost.service`: cached positions cost nothing, tokens that attend further cost more),
divided by its weight. Each step, the scheduler shares its token budget so that the least-served
tenants are served first (`allowances`: water-filling, each tenant up to what it can use), and
admits waiting requests least-served tenant first. A tenant that got more in past steps gets
less now, whatever the step sizes were.

No tenant banks credit (Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024):
- A tenant that comes back from idle starts at the lowest counter of the tenants whose work
  carried on (`begin_step`); when no tenant's work carries on from one step to the next (one
  set of tenants' work ended as another's began), every counter is forgotten.
- A tenant whose demand a step met in full (it was not held back) cannot stay more than `slack`
  behind the tenants that were held back, or behind every tenant with work when none was
  (`end_step`): a light tenant that sends a little at a time gets what it asks at once, and
  when it starts to flood it is ahead by at most `slack` (one step's budget).

Between two tenants of equal weight that are both held back step after step, the counters
stay within one step's service of each other (docs/architecture.md, I13).

Without `remember` (the "per_step" scheduling) every counter starts each step at zero and
weights are not used: the budget is split equally between the tenants with work, and nothing
carries to the next step.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

_LEVEL_ITERATIONS = 64


class FairShare:
    """The tenants' virtual counters and weights, kept by the engine thread's scheduler."""

    def __init__(self, slack: float, remember: bool = True) -> None:
        self.slack = slack
        self.remember = remember
        self.counters: dict[str, float] = {}
        self.weights: dict[str, float] = {}
        self._active: frozenset[str] = frozenset()

    def begin_step(self, weights: Mapping[str, float]) -> None:
        """The tenants with work this step and their weights (as their latest request says)."""
        active = frozenset(weights)
        self.weights = dict(weights) if self.remember else {}
        continuing = active & self._active
        if not self.remember or not continuing:
            self.counters = {}  # nobody's work carried on from the last step: nothing to weigh
        floor = min((self.counter(t) for t in continuing), default=0.0)
        for tenant in active - continuing:  # back from idle: no credit for the idle time
            self.counters[tenant] = max(self.counters.get(tenant, floor), floor)
        # An idle tenant's counter matters only while it is above every active one; all are
        # kept relative to the lowest active one, so they stay small however long the work.
        lowest = min(self.counter(t) for t in active) if active else 0.0
        self.counters = {
            t: c - lowest for t, c in self.counters.items() if t in active or c > floor
        }
        self._active = active

    def counter(self, tenant: str) -> float:
        return self.counters.get(tenant, 0.0)

    def allowances(self, budget: int, demands: Mapping[str, int]) -> dict[str, int]:
        """Tokens of `budget` for each tenant, least-served first: the counters after the step
        are as level as the tenants' demands allow (water-filling, each share in proportion
        to the tenant's weight)."""
        wanting = {t: d for t, d in demands.items() if d > 0}
        if sum(wanting.values()) <= budget:
            return dict(wanting)
        low = min(self.counter(t) for t in wanting)
        high = max(self.counter(t) for t in wanting) + budget / min(
            self._weight(t) for t in wanting
        )
        for _ in range(_LEVEL_ITERATIONS):
            level = (low + high) / 2
            if self._filled(level, wanting) < budget:
                low = level
            else:
                high = level
        shares = {t: int(self._fill(t, high, d)) for t, d in wanting.items()}
        spare = budget - sum(shares.values())
        for tenant in self.least_served(wanting):  # rounding: a token each, least-served first
            if spare <= 0:
                break
            if shares[tenant] < wanting[tenant]:
                shares[tenant] += 1
                spare -= 1
        return shares

    def least_served(self, tenants: Iterable[str]) -> list[str]:
        return sorted(tenants, key=self.counter)

    def charge(self, tenant: str, service: float) -> None:
        """Count `service` (prefill-token units) to the tenant, divided by its weight."""
        if self.remember:
            self.counters[tenant] = self.counter(tenant) + service / self._weight(tenant)

    def end_step(self, held_back: Iterable[str]) -> None:
        """Lift the tenants whose demand the step met to within `slack` of the reference: the
        least-served tenant that was held back, else the most-served tenant with work."""
        if not self.remember or not self._active:
            return
        held = set(held_back) & self._active
        active = [self.counter(t) for t in self._active]
        reference = min((self.counter(t) for t in held), default=max(active)) - self.slack
        for tenant in self._active - held:
            self.counters[tenant] = max(self.counter(tenant), reference)

    def _weight(self, tenant: str) -> float:
        return self.weights.get(tenant, 1.0)

    def _fill(self, tenant: str, level: float, demand: int) -> float:
        return min(float(demand), max(0.0, (level - self.counter(tenant)) * self._weight(tenant)))

    def _filled(self, level: float, demands: Mapping[str, int]) -> float:
        return sum(self._fill(t, level, d) for t, d in demands.items())
