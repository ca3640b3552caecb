"""What speculation can gain, from acceptance per position and the cost of speculating, and which k to use.

One verify step of a request with k draft tokens emits E_k = 1 + a_1 + ... + a_k tokens, where a_j is vLLM's
per-position acceptance rate (the share of verify steps whose draft tokens 1..j were all accepted: a chain stops at
its first rejection). Greedy drafting makes a_j nearly the same whatever k is, so the a_j measured at the largest k
serve every smaller k.

A speculative step costs, in target steps, c(k) = 1 + s + k r: the target's verify pass, a fixed overhead s per step
(what speculating costs whatever k is: the draft's pass over the newly accepted tokens, proposer and rejection-sampler
bookkeeping) and r per draft token (one draft forward plus one more verified position). So

    speed-up(k) = E_k / (1 + s + k r)     and E_k alone is the limit of a free draft (s = r = 0).

With s = 0 this is Leviathan et al. (2023). On this CPU the fixed part is not small: the step costs measured across
k = 1..5 in one sweep were 2.1 to 2.8 target steps at concurrency 1, almost flat in k (see BENCHMARKS.md), which a
model without s cannot express. Each served k gives its step cost as c(k) = E_k / measured speed-up; s and r come
from the smallest and the largest k of the sweep (r alone, s = 0, when only one k was measured), and every k in
between is a prediction the sweep checks.
"""

from __future__ import annotations

from pydantic import BaseModel, Field


def tokens_per_step(per_position: list[float], k: int) -> float:
    """E_k: tokens one verify step emits with k draft tokens (the bonus token included)."""
    if k > len(per_position):
        raise ValueError(f"acceptance was measured for {len(per_position)} positions, not {k}: measure with a "
                         f"larger num_speculative_tokens")
    return 1.0 + sum(per_position[:k])


def step_cost(per_position: list[float], k: int, measured_speedup: float) -> float:
    """c(k) in target steps: what a speculative step must have cost for E_k tokens to give the measured speed-up."""
    if measured_speedup <= 0:
        raise ValueError("a measured speed-up must be positive")
    return tokens_per_step(per_position, k) / measured_speedup


class CostModel(BaseModel):
    """c(k) = 1 + fixed + k per_draft_token, in target steps."""

    fixed: float = Field(description="s: overhead of a speculative step whatever k is, in target steps.")
    per_draft_token: float = Field(description="r: cost of one more draft token, in target steps.")
    calibrated_at_k: list[int] = Field(description="The served k whose measured step costs gave s and r.")

    def cost(self, k: int) -> float:
        return 1.0 + self.fixed + k * self.per_draft_token

    def speedup(self, per_position: list[float], k: int) -> float:
        return tokens_per_step(per_position, k) / self.cost(k)


def fit_cost_model(step_costs: dict[int, float]) -> CostModel:
    """s and r through the step costs of the smallest and largest k; r alone (s = 0) from a single k."""
    if not step_costs:
        raise ValueError("no measured step cost: serve at least one k")
    lo, hi = min(step_costs), max(step_costs)
    if lo == hi:
        return CostModel(fixed=0.0, per_draft_token=(step_costs[lo] - 1.0) / lo, calibrated_at_k=[lo])
    # A draft token cannot make a step cheaper: noise that tilts the line downwards leaves it flat.
    r = max(0.0, (step_costs[hi] - step_costs[lo]) / (hi - lo))
    return CostModel(fixed=step_costs[lo] - 1.0 - lo * r, per_draft_token=r, calibrated_at_k=[lo, hi])


class Recommendation(BaseModel):
    """The num_speculative_tokens the model predicts to be fastest at one concurrency, and how the sweep agrees."""

    concurrency: int
    cost: CostModel
    acceptance_from_k: int = Field(description="The served k whose per-position acceptance the predictions use.")
    per_position_acceptance: list[float]
    measured_step_cost_by_k: dict[int, float] = Field(description="c(k) = E_k / measured speed-up, target steps.")
    predicted_speedup_by_k: dict[int, float] = Field(description="E_k / c(k) for each k up to acceptance_from_k.")
    limit_speedup_by_k: dict[int, float] = Field(description="E_k: the speed-up of a free draft.")
    recommended_k: int | None = Field(description="None: turn speculation off (no k is predicted to win).")
    measured_speedup_by_k: dict[int, float] = Field(description="Median paired speed-up measured at each k.")
    measured_best_k: int | None = Field(description="Fastest measured setting; None: off was fastest.")
    verdict: str = Field(description="How the prediction compares with the measured sweep.")


def recommend(concurrency: int, per_position: list[float], measured: dict[int, tuple[float, float, float]]
              ) -> Recommendation:
    """`per_position`: acceptance measured at the largest k. `measured`: k -> (median paired speed-up, its slowest
    round, E_k measured at that k)."""
    costs = {k: e_k / median for k, (median, _, e_k) in measured.items()}
    model = fit_cost_model(costs)
    ks = range(1, len(per_position) + 1)
    predicted = {k: model.speedup(per_position, k) for k in ks}
    best_k = max(predicted, key=predicted.__getitem__)
    recommended = best_k if predicted[best_k] > 1.0 else None
    measured_best, verdict = _check(recommended, {k: (m, lo) for k, (m, lo, _) in measured.items()})
    return Recommendation(concurrency=concurrency, cost=model, acceptance_from_k=len(per_position),
                          per_position_acceptance=per_position, measured_step_cost_by_k=costs,
                          predicted_speedup_by_k=predicted,
                          limit_speedup_by_k={k: tokens_per_step(per_position, k) for k in ks},
                          recommended_k=recommended, measured_speedup_by_k={k: m for k, (m, _, _) in measured.items()},
                          measured_best_k=measured_best, verdict=verdict)


def _check(recommended: int | None, measured: dict[int, tuple[float, float]]) -> tuple[int | None, str]:
    best = max(measured, key=lambda k: measured[k][0])
    best_k = best if measured[best][0] > 1.0 else None
    name = {None: "off"} | {k: f"k={k}" for k in measured}
    if recommended == best_k:
        return best_k, f"agrees: {name[best_k]} was also the fastest measured"
    if recommended is not None and recommended not in measured:
        return best_k, f"k={recommended} was not measured; the fastest measured was {name[best_k]}"
    at_recommended = 1.0 if recommended is None else measured[recommended][0]
    best_median = 1.0 if best_k is None else measured[best_k][0]
    floor_of_best = 1.0 if best_k is None else measured[best_k][1]
    if at_recommended >= floor_of_best:
        return best_k, (f"within noise: {name[recommended]} measured {at_recommended:.2f}x, the fastest "
                        f"{name[best_k]} {best_median:.2f}x (its slowest round {floor_of_best:.2f}x)")
    return best_k, (f"disagrees: {name[recommended]} measured {at_recommended:.2f}x, the fastest {name[best_k]} "
                    f"{best_median:.2f}x")
