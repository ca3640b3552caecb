"""What a run of `kimi-eagle bench speedup` measures (the full plan, under 15 minutes on 2 cores, and the quick one CI
runs), and what the modes that start one server at a time share: the size of a sample, the order of a round."""

from __future__ import annotations

from typing import TypeVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

T = TypeVar("T")


class BenchPlan(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mode: str = Field(description="`full` or `quick`.")
    ks: list[int] = Field(description="num_speculative_tokens values swept, one spec server each; the largest "
                                      "calibrates the speed-up model.")
    concurrency: list[int] = Field(description="Requests in flight during a throughput sample.")
    repeats: int = Field(ge=1, description="Interleaved A/B rounds per measurement.")
    max_tokens: int = Field(ge=2, description="Output tokens of every request (ignore_eos).")
    requests_per_sample: int = Field(ge=1, description="Requests per sample at concurrency 1; at concurrency c a "
                                                       "sample sends max(this, c), rounded up to a multiple of c.")
    ceiling_candidates: int = Field(ge=1, description="Repeating prompts probed for the always-accepted ceiling "
                                                      "(beside the pair's predictable prompts).")
    ceiling_requests_per_sample: int = Field(ge=1, description="Requests per ceiling sample at concurrency 1; at "
                                                               "concurrency c, as `requests_at` counts them.")
    checks_concurrency: list[int] = Field(description="Concurrency of the runtime-checks on/off comparison; empty: "
                                                      "skip it (it needs one more server start).")
    locust_run_time: str = Field(description="Length of the Locust run at the highest concurrency.")
    vllm_overrides: dict[str, str] = Field(default_factory=dict, description="vLLM flags (without --) applied to "
                                           "every server on top of the profile's; reported with the results.")

    @model_validator(mode="after")
    def _sorted(self) -> BenchPlan:
        if not self.ks or min(self.ks) < 1:
            raise ValueError("ks must list at least one num_speculative_tokens >= 1")
        self.ks = sorted(set(self.ks))
        self.concurrency = sorted(set(self.concurrency))
        return self

    def requests_at(self, concurrency: int) -> int:
        return _whole_rounds(max(self.requests_per_sample, concurrency), concurrency)

    def ceiling_requests_at(self, concurrency: int) -> int:
        return _whole_rounds(max(self.ceiling_requests_per_sample, concurrency), concurrency)


def _whole_rounds(n: int, concurrency: int) -> int:
    """n rounded up to a multiple of the concurrency, so that every stream sends as many requests."""
    return -(-n // concurrency) * concurrency


FULL = BenchPlan(mode="full", ks=[1, 2, 3, 4, 5], concurrency=[1, 4, 16], repeats=5, max_tokens=64,
                 requests_per_sample=4, ceiling_candidates=3, ceiling_requests_per_sample=2,
                 checks_concurrency=[1, 16], locust_run_time="15s")
QUICK = BenchPlan(mode="quick", ks=[3], concurrency=[1, 4, 16], repeats=2, max_tokens=16, requests_per_sample=2,
                  ceiling_candidates=2, ceiling_requests_per_sample=1, checks_concurrency=[], locust_run_time="5s")


class StreamsPlan(BaseModel):
    """What the one-server-at-a-time modes (configs, tune, bypass) share: how many requests make one sample."""

    requests_per_stream: int = Field(ge=1, description="Requests each of the `concurrency` streams sends per "
                                                       "sample (at least 12 in all).")

    def requests_at(self, concurrency: int) -> int:
        return max(12, self.requests_per_stream * concurrency)


def rotated(items: list[T], round_no: int) -> list[T]:
    """Round r's order of the one-server-at-a-time modes: the items rotated by r - 1; once each has gone first, the
    rotations of the reverse order.

    Rotations alone run each item after the same neighbour (A B C, B C A, C A B: C always follows B), so whatever a
    load leaves behind for the sample after it (a server winding down, the caches it filled) would count against
    one configuration only. Over 2n rounds every item is first twice and, for up to three items, runs right after
    each other item equally often."""
    n = len(items)
    base = items if (round_no - 1) // n % 2 == 0 else items[::-1]
    shift = (round_no - 1) % n
    return base[shift:] + base[:shift]
