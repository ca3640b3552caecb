"""The benchmark's results files (`bench/results/*.json`): what every mode records of its machine, the full speed-up
run's pydantic models (units in the field names), and what `kimi-eagle bench render` needs of each mode."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field

from kimi_eagle.bench.client import Sample
from kimi_eagle.bench.plan import BenchPlan
from kimi_eagle.bench.servers import ColdStart
from kimi_eagle.bench.speedup_model import Recommendation
from kimi_eagle.bench.stats import Spread

if TYPE_CHECKING:
    from kimi_eagle.bench.plots import Plot

RESULT_SCHEMA = "kimi-eagle/bench/1"


class Machine(BaseModel):
    cpu_model: str = Field(description="`model name` of /proc/cpuinfo, as lscpu prints it.")
    isa: str | None = Field(None, description="The CPU's vector ISA as vLLM decides by (\"AVX2\", \"AVX-512 + BF16 + "
                            "AMX\"); None in results recorded before it was (BENCHMARKS.md says which).")
    vllm_kernels: str | None = Field(None, description="The build of vLLM's CPU kernels the servers ran (`_C`, "
                                     "`_C_AVX512`, `_C_AVX2`); None off a CPU build and in older results.")
    cpus: int = Field(description="CPUs the OS shows (os.cpu_count()).")
    memory_gib: float
    load_average_before: list[float] = Field(description="1, 5, 15-minute load average when the run began.")
    load_average_after: list[float]
    vllm_version: str | None
    torch_version: str | None


def run_line(command: str, started_utc: str, duration_s: float, machine: Machine) -> str:
    """The opening of the report of bypass, configs, guidellm, startup and tune: what ran, when, how long, on what."""
    return (f"`{command}`, started {started_utc}, {duration_s / 60:.0f} min; {machine.cpu_model}, {machine.cpus} "
            f"CPUs{isa_note(machine)}, vLLM {machine.vllm_version}; ")


def isa_note(machine: Machine) -> str:
    """`, AVX2 (vLLM kernels _C_AVX2)`: the ISA a figure was measured on; empty for results that did not record it."""
    if machine.isa is None:
        return ""
    return f", {machine.isa}" + (f" (vLLM kernels {machine.vllm_kernels})" if machine.vllm_kernels else "")


class AcceptanceFigures(BaseModel):
    """vLLM's counters summed over every spec sample of one point (deltas around each sample)."""

    verify_steps: int
    draft_tokens: int
    accepted_tokens: int
    mean_acceptance_length: float | None = Field(description="1 + accepted / verify steps.")
    acceptance_rate: float | None = Field(description="Accepted / proposed draft tokens.")
    per_position: list[float] = Field(description="Index j: share of verify steps whose draft token j+1 was accepted.")


def summed_acceptance(samples: list[Sample]) -> AcceptanceFigures | None:
    """vLLM's counters over several samples: per-position rates weighted by each sample's verify steps."""
    figures = [s.acceptance for s in samples if s.acceptance is not None and s.acceptance.num_verify_steps]
    if not figures:
        return None
    steps = sum(a.num_verify_steps or 0 for a in figures)
    drafted = sum(a.num_draft_tokens or 0 for a in figures)
    accepted = sum(a.num_accepted_tokens or 0 for a in figures)
    positions = max(len(a.per_position_acceptance_rate or []) for a in figures)
    per_position = [sum((a.per_position_acceptance_rate or [0.0] * positions)[j] * (a.num_verify_steps or 0)
                        for a in figures) / steps for j in range(positions)]
    return AcceptanceFigures(verify_steps=steps, draft_tokens=drafted, accepted_tokens=accepted,
                             mean_acceptance_length=1 + accepted / steps,
                             acceptance_rate=accepted / drafted if drafted else None, per_position=per_position)


class ThroughputPoint(BaseModel):
    """Plain target (A) against target + draft (B) at one k and concurrency, interleaved A B A B."""

    workload: str = Field(description="`held-out`: the held-out prompts; `ceiling`: prompts the draft predicts "
                                      "(almost) always, measured the same way.")
    num_speculative_tokens: int
    concurrency: int
    requests_per_sample: int
    plain_tokens_per_s: Spread
    spec_tokens_per_s: Spread
    speedup_of_medians: float = Field(description="median(spec) / median(plain).")
    paired_speedup: Spread = Field(description="Round-by-round spec / plain.")
    acceptance: AcceptanceFigures | None
    identical_outputs: list[int] | None = Field(None, description="[same, compared]: greedy outputs of the first "
                                                                  "round, plain vs spec, at concurrency 1.")


class ChecksOverhead(BaseModel):
    """The same spec configuration with KIMI_EAGLE_RUNTIME_CHECKS=1 (A) and =0 (B), interleaved."""

    num_speculative_tokens: int
    concurrency: int
    checks_on_tokens_per_s: Spread
    checks_off_tokens_per_s: Spread
    cost_percent: float = Field(description="(median off / median on - 1) x 100: tokens/s the checks cost.")
    paired_off_over_on: Spread
    noise_band_percent: float = Field(description="Half the larger relative range (max - min) / median of the two "
                                                  "sides, x 100: differences inside it are noise.")
    verdict: str


class HarnessOverhead(BaseModel):
    """Locust (kimi-eagle loadtest's runner, non-streamed, same prompts) against this benchmark's own client."""

    concurrency: int
    server: str
    own_client_tokens_per_s: Spread
    own_client_cpu_s_per_1k_tokens: float = Field(description="CPU of the client process per 1,000 output tokens.")
    own_client_cpu_percent: float = Field(description="Client CPU time / wall time while sampling (100 = one core).")
    locust_tokens_per_s: float | None
    locust_cpu_percent: float = Field(description="Locust's CPU time / wall time of the whole Locust process, start-up "
                                                  "included (100 = one core).")
    locust_wall_s: float
    locust_cpu_s_per_1k_tokens: float | None = Field(description="CPU of the Locust process (getrusage of "
                                                                 "children), start-up included, per 1,000 output "
                                                                 "tokens.")
    locust_requests_ok: int | None
    locust_harness_cpu_percent_max: float | None
    locust_results: str = Field(description="Locust's results folder.")
    tokens_per_s_lost_percent: float | None = Field(description="(1 - Locust / median own client) x 100.")


class CeilingProbe(BaseModel):
    prompt: str
    acceptance_rate: float | None
    mean_acceptance_length: float | None


class BenchResult(BaseModel):
    schema_id: str = Field(RESULT_SCHEMA, alias="schema")
    mode: str
    command: str = Field(description="The command line that produced this file.")
    started_utc: str
    duration_s: float
    machine: Machine
    profile: str
    target: str
    draft: str
    prompts_file: str
    plan: BenchPlan
    ceiling_prompt: str | None = Field(description="The best probed ceiling prompt.")
    ceiling_prompts: list[str] = Field(default_factory=list, description="Every prompt the ceiling workload sends "
                                       "(within 0.05 of the best probed acceptance rate); empty in older results.")
    ceiling_probes: list[CeilingProbe]
    throughput: list[ThroughputPoint]
    cold_starts: list[ColdStart]
    checks: list[ChecksOverhead]
    harness: HarnessOverhead | None
    recommendations: list[Recommendation]
    notes: list[str] = Field(default_factory=list)

    model_config = {"populate_by_name": True}


def fault_named(name: str, fault: str | None) -> str:
    """`name`, or `name-FAULT` for a run made with KIMI_EAGLE_FAULT=FAULT: a machine made one where drafting costs
    is not this machine's figure, so such a run's files and plots are named apart from the plain mode's."""
    return f"{name}-{fault}" if fault else name


@dataclass(frozen=True)
class ModeResults:
    """A mode's results files as `kimi-eagle bench render` reads them: `<prefix>-<YYYYmmdd-HHMMSS>.json` (a quick
    run's prefix has `quick` in it, so that it is never taken for a measurement), the model that reads one, the
    Markdown report made of it, and its plots (written into a folder, returned in the order they are shown)."""

    mode: str  # the subcommand, `kimi-eagle bench MODE`, and the name of its section in a rendered file
    prefix: str
    model: type[BaseModel]
    markdown: Callable[[Any], str]
    plots: Callable[[Any, Path], list[Plot]]

    def runs(self, folder: Path, fault: str = "") -> list[Path]:
        """This mode's measured runs in `folder`, oldest first (the stamp in the name is the start time); with
        `fault`, those made with KIMI_EAGLE_FAULT=fault (`<prefix>-<fault>-<time>.json`) instead."""
        prefix = fault_named(self.prefix, fault)
        name = re.compile(rf"{re.escape(prefix)}-\d{{8}}-\d{{6}}\.json")
        return sorted(p for p in folder.glob(f"{prefix}-*.json") if name.fullmatch(p.name))

    def load(self, path: Path) -> Any:
        return self.model.model_validate_json(path.read_text())
