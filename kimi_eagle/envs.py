"""Every `KIMI_EAGLE_*` environment variable, declared once with its default and meaning, as vLLM's `vllm/envs.py`
does. Each is read when asked for, not at import: the plugin is imported in every vLLM process, some of them before
the environment they will run with is final."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Knob:
    name: str
    default: str
    meaning: str

    def get(self) -> str:
        return os.environ.get(self.name, self.default)


RUNTIME_CHECKS = Knob("KIMI_EAGLE_RUNTIME_CHECKS", "1",
                      "0 turns off the draft guards, the acceptance alarm and the draft fail-safe inside vLLM (the CPU "
                      "fixes stay); `make bench` measures what they cost with it")
STATIC_CHECKS = Knob("KIMI_EAGLE_STATIC_CHECKS", "1",
                     "0 skips only the static file checks at engine start (a draft that is not a local folder)")
ALARM_WINDOW_DRAFTS = Knob("KIMI_EAGLE_ALARM_WINDOW_DRAFTS", "200",
                           "drafts in the acceptance alarm's window")
ALARM_MIN_RATE = Knob("KIMI_EAGLE_ALARM_MIN_RATE", "0.05",
                      "accepted / drafted tokens over the window below which the alarm goes off")
BYPASS = Knob("KIMI_EAGLE_BYPASS", "1",
               "0 turns off the draft fail-safe (the engine stops drafting when acceptance collapses); the alarm "
               "stays")
BYPASS_RETRY_S = Knob("KIMI_EAGLE_BYPASS_RETRY_S", "300",
                      "seconds between retries of a bypassed draft (one alarm window of drafts each); 0: never retry")
MEASURED_K = Knob("KIMI_EAGLE_MEASURED_K", "1",
                  "0 keeps the profile's draft tokens per batch size as it is; 1 lets the engine choose k per range of "
                  "batch sizes from what its decode steps cost (adapter/measured_k.py); the benchmarks measure "
                  "fixed schedules with 0")
MEASURED_K_PROBE_SHARE = Knob("KIMI_EAGLE_MEASURED_K_PROBE_SHARE", "0.05",
                              "the largest share of a batch-size range's decode steps spent probing another k")
CPU_LAYOUT = Knob("KIMI_EAGLE_CPU_LAYOUT", "shared",
                  "on a CPU, `shared` runs the engine core on its workers' cores (leaving vLLM's reserved cores to "
                  "the API server); `vllm` keeps vLLM's layout, where the engine core floats")
FAULT = Knob("KIMI_EAGLE_FAULT", "",
             "fault injection for the project's own tests: `aux-single-layer` makes the target capture one aux layer; "
             "`upstream-top-k` leaves vLLM's CPU top-k in place (a top-k request at T > 0 then fails the engine); "
             "`slow-draft` adds 15 ms per draft token to each draft pass (a machine on which drafting costs)")

KNOBS = (RUNTIME_CHECKS, STATIC_CHECKS, ALARM_WINDOW_DRAFTS, ALARM_MIN_RATE, BYPASS, BYPASS_RETRY_S, MEASURED_K,
         MEASURED_K_PROBE_SHARE, CPU_LAYOUT, FAULT)


def runtime_checks() -> bool:
    return RUNTIME_CHECKS.get() != "0"


def static_checks() -> bool:
    return STATIC_CHECKS.get() != "0"


def alarm_window_drafts() -> int:
    return int(ALARM_WINDOW_DRAFTS.get())


def alarm_min_rate() -> float:
    return float(ALARM_MIN_RATE.get())


def bypass_enabled() -> bool:
    return BYPASS.get() != "0"


def bypass_retry_s() -> float:
    return float(BYPASS_RETRY_S.get())


def measured_k() -> bool:
    return MEASURED_K.get() != "0"


def measured_k_probe_share() -> float:
    return float(MEASURED_K_PROBE_SHARE.get())


def cpu_layout() -> str:
    return CPU_LAYOUT.get()


def fault() -> str:
    return FAULT.get()
