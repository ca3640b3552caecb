"""Acceptance under one definition, whatever engine reported it: the figures of a run, of one request, and how an
engine's own figures convert to them. Used by the load test, doctor and the benchmark alike.

Definitions used everywhere in this project (vLLM's; SGLang's figures are converted to them):

- mean acceptance length = tokens emitted per verify step of one request, bonus token included
  = 1 + accepted draft tokens / verify steps. vLLM: 1 + `spec_decode_num_accepted_tokens` / `spec_decode_num_drafts`.
- acceptance rate = accepted draft tokens / proposed draft tokens. vLLM: accepted / `spec_decode_num_draft_tokens`.
- per-position rate i = verify steps whose draft token i was accepted / verify steps.

SGLang (read in its source, 0.5.x; see docs in `describe_sources`):
- per request (`return_spec_tokens_details: true` -> `sglext.spec_tokens_details`, or `meta_info` of /generate):
  `spec_verify_ct` verify steps, `spec_num_correct_drafts` accepted drafts, `spec_num_proposed_drafts`;
  `spec_accept_length` = completion_tokens / spec_verify_ct (counts the token from prefill too, so it is NOT
  1 + accepted/steps), `spec_accept_rate` = correct drafts / (verify steps x (num_draft_tokens - 1)).
  We use 1 + sum(correct) / sum(verify_ct) and sum(correct) / sum(proposed): vLLM's definitions.
  Per-position rates come from the summed `spec_correct_drafts_histogram` (index j: steps with j accepted).
- gauges `sglang:spec_accept_length` ((accepted + bonus) / verify steps) and `sglang:spec_accept_rate` hold the
  last logging window only (`decode_log_interval` batches): not a run's delta. Reported as such, never compared.
- `/get_server_info` `internal_states[0].avg_spec_accept_length`: the same ratio cumulative since boot.
- counter `sglang:spec_verify_calls_total`, where the server has it: with `sglang:generation_tokens_total` gives
  a run delta of tokens per verify step (it includes each request's first token from prefill).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field


def ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den <= 0:
        return None
    return num / den


class MeasuredKRange(BaseModel):
    """A kimi-eagle engine's draft tokens for one range of batch sizes, as its `kimi_eagle:measured_k*` gauges
    said at the end of a run (adapter/measured_k.py)."""

    batch_sizes: str = Field(description="The range, e.g. \"3-4\".")
    k: int = Field(description="Draft tokens per step in force.")
    configured: int | None = Field(None, description="The profile's k for the range.")
    steps: int | None = Field(None, description="Decode steps of the range the engine timed.")
    speed_ratio: dict[int, float] = Field(default_factory=dict, description="Other k -> its tokens/s over the k in "
                                                                            "force's, where measured.")


class Acceptance(BaseModel):
    """Acceptance over one run, in this project's one definition (module docstring)."""

    speculation: Literal["on", "off", "unknown"] = Field(description="Whether the server speculates at all.")
    source: str = Field(description="How the figures were derived, in words.")
    num_verify_steps: int | None = Field(None, description="Verify steps (vLLM: drafts) during the run.")
    num_draft_tokens: int | None = Field(None, description="Draft tokens proposed during the run.")
    num_accepted_tokens: int | None = Field(None, description="Draft tokens accepted during the run.")
    num_speculative_tokens: int | None = Field(None, description="k: draft tokens proposed per verify step.")
    acceptance_rate: float | None = Field(None, description="Accepted / proposed draft tokens.")
    mean_acceptance_length: float | None = Field(None, description="1 + accepted / verify steps.")
    per_position_acceptance_rate: list[float] | None = Field(None, description="Index i: draft token i accepted.")
    measured_k: list[MeasuredKRange] | None = Field(
        None, description="A kimi-eagle engine's k per batch-size range at the end of the run, and the measurement "
                          "behind it (None: an engine without the measured k).")
    engine_reported: dict[str, float | None] = Field(
        default_factory=dict, description="The engine's own figures as it reports them (other definitions or "
                                          "windows; see `source`), kept for reference, never compared.")


class SpecRequestFigures(BaseModel):
    """Per-request speculative-decoding figures returned by the engine (vLLM or SGLang), as given."""

    source: str = Field(description="Which response field they came from.")
    mean_acceptance_length: float | None = Field(None, description="Tokens per verify step, bonus included.")
    acceptance_rate: float | None = Field(None, description="Accepted / proposed draft tokens, as the engine "
                                                              "defines it (see engines.py).")
    num_verify_steps: int | None = None
    num_draft_tokens: int | None = None
    num_accepted_tokens: int | None = None
    acceptance_histogram: list[int] | None = Field(
        None, description="Index j: verify steps that accepted exactly j draft tokens (vLLM acceptance_histogram, "
                          "SGLang spec_correct_drafts_histogram).")


def spec_figures_from(payload: dict[str, Any]) -> SpecRequestFigures | None:
    """Find per-request acceptance figures in a response body or final chunk: vLLM's
    `metrics.speculative_decoding` (--per-request-spec-decode-metrics) or SGLang's `sglext.spec_tokens_details`
    / `meta_info` (return_spec_tokens_details)."""
    vllm = (payload.get("metrics") or {}).get("speculative_decoding")
    if vllm:
        return SpecRequestFigures(source="vllm metrics.speculative_decoding",
                                  mean_acceptance_length=vllm.get("mean_acceptance_length"),
                                  acceptance_rate=vllm.get("draft_acceptance_rate"),
                                  num_verify_steps=vllm.get("num_spec_steps"),
                                  num_draft_tokens=vllm.get("num_draft_tokens"),
                                  num_accepted_tokens=vllm.get("num_accepted_draft_tokens"),
                                  acceptance_histogram=vllm.get("acceptance_histogram"))
    return sglang_request_figures(payload)


def sglang_request_figures(payload: dict[str, Any]) -> SpecRequestFigures | None:
    """SGLang's per-request figures from an OpenAI response (`sglext.spec_tokens_details`, at the top or in a
    choice) or a /generate body (`meta_info`), converted to this project's definitions."""
    candidates = [(payload.get("sglext") or {}).get("spec_tokens_details"), payload.get("meta_info")]
    for choice in payload.get("choices") or []:
        candidates.append((choice.get("sglext") or {}).get("spec_tokens_details"))
    for details in candidates:
        if not details or not details.get("spec_verify_ct"):
            continue
        steps = int(details["spec_verify_ct"])
        correct = details.get("spec_num_correct_drafts")
        proposed = details.get("spec_num_proposed_drafts")
        return SpecRequestFigures(
            source="sglang spec_tokens_details" if "spec_num_correct_drafts" in details else "sglang meta_info",
            num_verify_steps=steps,
            num_accepted_tokens=None if correct is None else int(correct),
            num_draft_tokens=None if proposed is None else int(proposed),
            mean_acceptance_length=None if correct is None else 1 + correct / steps,
            acceptance_rate=ratio(correct, proposed),
            acceptance_histogram=details.get("spec_correct_drafts_histogram") or None)
    return None


def per_position_from_histograms(histograms: list[list[int]]) -> list[float] | None:
    """Per-position acceptance from per-request histograms (index j: verify steps that accepted exactly j
    drafts): draft position i was accepted in every step that accepted more than i drafts."""
    if not histograms:
        return None
    width = max(len(h) for h in histograms)
    total = [sum(h[j] if j < len(h) else 0 for h in histograms) for j in range(width)]
    steps = sum(total)
    if steps == 0 or width < 2:
        return None
    return [sum(total[i + 1:]) / steps for i in range(width - 1)]
