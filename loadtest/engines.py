"""Read an engine's own counters (Prometheus `/metrics`, server info) before and after a run over HTTP, and turn them
into acceptance figures under the one definition of `kimi_eagle.acceptance`."""

from __future__ import annotations

import os
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

import requests
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, Field

from kimi_eagle.acceptance import Acceptance, MeasuredKRange, per_position_from_histograms, ratio
from kimi_eagle.loadtest.records import RequestRecord


class EngineError(RuntimeError):
    """The engine's HTTP endpoints could not be read; the message names the URL and the fix."""


API_KEY_ENVS = ("VLLM_API_KEY", "OPENAI_API_KEY")


def api_key_from_env() -> str | None:
    """The key a protected server wants, from the first of API_KEY_ENVS that is set (vLLM's own name first)."""
    return next((key for name in API_KEY_ENVS if (key := os.environ.get(name))), None)


def auth_headers(api_key: str | None) -> dict[str, str]:
    """`Authorization: Bearer` for a key; nothing without one. Never log the result."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


class Sample(BaseModel):
    name: str
    labels: dict[str, str]
    value: float


class EngineSnapshot(BaseModel):
    """What an engine said about itself at one moment (only the series this project reads are kept)."""

    kind: str
    taken_unix_s: float
    samples: list[Sample] = Field(default_factory=list)
    server_info: dict[str, Any] | None = Field(None, description="The engine's own description of its settings.")

    def total(self, name: str, **labels: str) -> float | None:
        """Sum of the samples called `name` whose labels include `labels`; None when there is none."""
        values = [s.value for s in self.samples
                  if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
        return sum(values) if values else None

    def by_label(self, name: str, label: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for s in self.samples:
            if s.name == name and label in s.labels:
                out[s.labels[label]] = out.get(s.labels[label], 0.0) + s.value
        return out


class ServerTiming(BaseModel):
    """The engine's own TTFT histogram over the run, to measure what the harness adds."""

    requests: int | None = None
    mean_ttft_ms: float | None = Field(None, description="Server-side mean TTFT over the run (histogram delta).")


class ServerConfig(BaseModel):
    """Settings that make two servers comparable, as far as each server exposes them (None: not exposed)."""

    kind: str
    model: str | None = None
    speculative_method: str | None = None
    num_speculative_tokens: int | None = Field(None, description="k (SGLang: speculative_num_steps, topk 1).")
    max_num_seqs: int | None = Field(None, description="vLLM --max-num-seqs / SGLang max_running_requests.")
    dtype: str | None = None
    tensor_parallel_size: int | None = None
    pipeline_parallel_size: int | None = None
    data_parallel_size: int | None = None
    max_model_len: int | None = None
    notes: list[str] = Field(default_factory=list)


def parse_metrics(text: str, keep: Callable[[str], bool]) -> list[Sample]:
    """Prometheus text -> the samples whose name passes `keep`, with prometheus_client's own parser."""
    out: list[Sample] = []
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if keep(s.name):
                out.append(Sample(name=s.name, labels=dict(s.labels), value=float(s.value)))
    return out


def _delta(before: EngineSnapshot, after: EngineSnapshot, name: str, **labels: str) -> float | None:
    a, b = after.total(name, **labels), before.total(name, **labels)
    if a is None:
        return None
    return a - (b or 0.0)


class EngineReader(ABC):
    """How to read one kind of engine. Subclasses register with @register_engine."""

    kind: ClassVar[str]
    metric_prefix: ClassVar[str]

    def __init__(self, url: str, timeout_s: float = 10.0, api_key: str | None = None) -> None:
        """`api_key` None: the one in the environment (`api_key_from_env`), if any."""
        self.url = url.rstrip("/").removesuffix("/v1")
        self.timeout_s = timeout_s
        self.headers = auth_headers(api_key or api_key_from_env())

    def _get(self, path: str) -> requests.Response:
        try:
            response = requests.get(f"{self.url}{path}", timeout=self.timeout_s, headers=self.headers)
        except requests.RequestException as exc:
            raise EngineError(f"cannot reach {self.url}{path}: {exc.__class__.__name__}: is the server running "
                              f"and the URL right?") from None
        if response.status_code in (401, 403):
            told = "the key in the environment was refused" if self.headers else "no key was sent"
            raise EngineError(f"{self.url}{path} answered {response.status_code}: the server wants an API key and "
                              f"{told}: set {' or '.join(API_KEY_ENVS)} to the key it was started with")
        return response

    def metrics_text(self) -> str:
        response = self._get("/metrics")
        if response.status_code != 200:
            raise EngineError(f"{self.url}/metrics answered {response.status_code}: {self.kind} metrics are off "
                              f"({self.metrics_hint})")
        return response.text

    metrics_hint: ClassVar[str] = ""

    def keep(self, name: str) -> bool:
        return name.startswith(self.metric_prefix)

    def snapshot(self) -> EngineSnapshot:
        return EngineSnapshot(kind=self.kind, taken_unix_s=time.time(),
                              samples=parse_metrics(self.metrics_text(), self.keep),
                              server_info=self.server_info())

    def served_model(self) -> str:
        response = self._get("/v1/models")
        try:
            return response.json()["data"][0]["id"]
        except (ValueError, KeyError, IndexError):
            raise EngineError(f"{self.url}/v1/models gave no model (status {response.status_code}): "
                              f"give --model") from None

    def server_timing(self, before: EngineSnapshot, after: EngineSnapshot) -> ServerTiming:
        p = self.metric_prefix
        count = _delta(before, after, f"{p}time_to_first_token_seconds_count")
        total = _delta(before, after, f"{p}time_to_first_token_seconds_sum")
        mean = ratio(total, count)
        return ServerTiming(requests=None if count is None else round(count),
                            mean_ttft_ms=None if mean is None else mean * 1000)

    @abstractmethod
    def server_info(self) -> dict[str, Any] | None:
        """The engine's description of its own settings, or None where it has no such endpoint."""

    @abstractmethod
    def server_config(self, snapshot: EngineSnapshot) -> ServerConfig:
        """Comparable settings, from a snapshot (and /v1/models)."""

    @abstractmethod
    def acceptance(self, before: EngineSnapshot, after: EngineSnapshot,
                   records: list[RequestRecord]) -> Acceptance:
        """Acceptance over the run between two snapshots."""

    def request_extras(self) -> dict[str, Any]:
        """Engine-specific fields every request carries."""
        return {}


ENGINES: dict[str, type[EngineReader]] = {}


def register_engine(cls: type[EngineReader]) -> type[EngineReader]:
    ENGINES[cls.kind] = cls
    return cls


def get_engine(kind: str, url: str, **kwargs: Any) -> EngineReader:
    if kind not in ENGINES:
        raise EngineError(f"unknown engine kind {kind!r}: known kinds are {', '.join(sorted(ENGINES))}")
    return ENGINES[kind](url, **kwargs)


@register_engine
class VllmReader(EngineReader):
    kind = "vllm"
    metric_prefix = "vllm:"
    metrics_hint = "vLLM serves /metrics unless --disable-log-stats is given"

    def keep(self, name: str) -> bool:
        return name.startswith(("vllm:spec_decode", "vllm:time_to_first_token_seconds_", "vllm:generation_tokens",
                                "vllm:request_success", "vllm:cache_config_info", "vllm:e2e_request_latency_s",
                                "kimi_eagle:measured_k"))

    def server_info(self) -> dict[str, Any] | None:
        response = self._get("/v1/models")
        if response.status_code != 200:
            return None
        return {"v1_models": response.json()}

    def server_config(self, snapshot: EngineSnapshot) -> ServerConfig:
        models = ((snapshot.server_info or {}).get("v1_models") or {}).get("data") or [{}]
        positions = snapshot.by_label("vllm:spec_decode_num_accepted_tokens_per_pos_total", "position")
        spec_on = snapshot.total("vllm:spec_decode_num_drafts_total") is not None
        cache = next((s.labels for s in snapshot.samples if s.name == "vllm:cache_config_info"), {})
        return ServerConfig(
            kind=self.kind, model=models[0].get("id"), max_model_len=models[0].get("max_model_len"),
            # No vllm:spec_decode_* series at all means vLLM was started without a speculative config.
            speculative_method="on (method not exposed)" if spec_on else "none",
            num_speculative_tokens=len(positions) if spec_on else 0,
            notes=["vLLM exposes no dtype, --max-num-seqs or parallel sizes over HTTP; "
                   f"KV cache dtype {cache.get('cache_dtype', 'not exposed')}"])

    def acceptance(self, before: EngineSnapshot, after: EngineSnapshot,
                   records: list[RequestRecord]) -> Acceptance:
        if after.total("vllm:spec_decode_num_drafts_total") is None:
            return Acceptance(speculation="off", source="vLLM exports no vllm:spec_decode_* counters: the server "
                                                        "runs without speculative decoding")
        drafts = _delta(before, after, "vllm:spec_decode_num_drafts_total")
        drafted = _delta(before, after, "vllm:spec_decode_num_draft_tokens_total")
        accepted = _delta(before, after, "vllm:spec_decode_num_accepted_tokens_total")
        pos_after = after.by_label("vllm:spec_decode_num_accepted_tokens_per_pos_total", "position")
        pos_before = before.by_label("vllm:spec_decode_num_accepted_tokens_per_pos_total", "position")
        per_position = None
        if drafts:
            per_position = [(pos_after[p] - pos_before.get(p, 0.0)) / drafts
                            for p in sorted(pos_after, key=int)]
        length = ratio(accepted, drafts)
        return Acceptance(
            speculation="on",
            source="vLLM Prometheus counters vllm:spec_decode_num_{drafts,draft_tokens,accepted_tokens}_total and "
                   "..._accepted_tokens_per_pos_total, after minus before the run",
            num_verify_steps=None if drafts is None else round(drafts),
            num_draft_tokens=None if drafted is None else round(drafted),
            num_accepted_tokens=None if accepted is None else round(accepted),
            num_speculative_tokens=len(pos_after) or None,
            acceptance_rate=ratio(accepted, drafted),
            mean_acceptance_length=None if length is None else 1 + length,
            per_position_acceptance_rate=per_position,
            measured_k=measured_k(after))


def measured_k(snapshot: EngineSnapshot) -> list[MeasuredKRange] | None:
    """A kimi-eagle engine's k per batch-size range from its `kimi_eagle:measured_k*` gauges; None without them."""
    in_force = snapshot.by_label("kimi_eagle:measured_k", "batch_sizes")
    if not in_force:
        return None
    configured = snapshot.by_label("kimi_eagle:measured_k_configured", "batch_sizes")
    steps = snapshot.by_label("kimi_eagle:measured_k_steps", "batch_sizes")
    ranges = []
    for name in sorted(in_force, key=lambda n: int(n.split("-")[0])):
        ratios = {int(s.labels["k"]): s.value for s in snapshot.samples
                  if s.name == "kimi_eagle:measured_k_speed_ratio" and s.labels.get("batch_sizes") == name}
        k = round(in_force[name])
        ranges.append(MeasuredKRange(
            batch_sizes=name, k=k, configured=round(configured[name]) if name in configured else None,
            steps=round(steps[name]) if name in steps else None,
            speed_ratio={other: ratio for other, ratio in sorted(ratios.items()) if other != k}))
    return ranges


def sglang_num_speculative_tokens(server_info: dict[str, Any] | None) -> int | None:
    """k in vLLM's sense: draft tokens proposed per verify step along one chain. SGLang's
    `speculative_num_draft_tokens` counts the verified root token too, so for topk 1 k = num_draft_tokens - 1."""
    if not server_info:
        return None
    draft_tokens = server_info.get("speculative_num_draft_tokens")
    if draft_tokens and (server_info.get("speculative_eagle_topk") or 1) == 1:
        return int(draft_tokens) - 1
    return server_info.get("speculative_num_steps")


@register_engine
class SglangReader(EngineReader):
    kind = "sglang"
    metric_prefix = "sglang:"
    metrics_hint = "start SGLang with --enable-metrics"

    def keep(self, name: str) -> bool:
        return name.startswith(("sglang:spec_", "sglang:time_to_first_token_seconds_", "sglang:generation_tokens_total",
                                "sglang:num_requests_total"))

    def server_info(self) -> dict[str, Any] | None:
        for path in ("/get_server_info", "/server_info"):
            response = self._get(path)
            if response.status_code == 200:
                return response.json()
        return None

    def request_extras(self) -> dict[str, Any]:
        return {"return_spec_tokens_details": True}

    def server_config(self, snapshot: EngineSnapshot) -> ServerConfig:
        info = snapshot.server_info or {}
        served = info.get("served_model_name")
        return ServerConfig(
            kind=self.kind, model=served[0] if isinstance(served, list) else served,
            speculative_method=info.get("speculative_algorithm"),
            num_speculative_tokens=sglang_num_speculative_tokens(info),
            max_num_seqs=info.get("max_running_requests") or _first_state(info).get(
                "effective_max_running_requests_per_dp"),
            dtype=info.get("dtype"), tensor_parallel_size=info.get("tp_size"),
            pipeline_parallel_size=info.get("pp_size"), data_parallel_size=info.get("dp_size"),
            max_model_len=info.get("context_length") or info.get("max_req_input_len"),
            notes=["from /get_server_info"])

    def acceptance(self, before: EngineSnapshot, after: EngineSnapshot,
                   records: list[RequestRecord]) -> Acceptance:
        info = after.server_info or {}
        k = sglang_num_speculative_tokens(info)
        reported = {
            "gauge spec_accept_length (last log window)": after.total("sglang:spec_accept_length"),
            "gauge spec_accept_rate (last log window)": after.total("sglang:spec_accept_rate"),
            "avg_spec_accept_length since boot, before": _first_state(before.server_info).get(
                "avg_spec_accept_length"),
            "avg_spec_accept_length since boot, after": _first_state(info).get("avg_spec_accept_length"),
        }
        if not info.get("speculative_algorithm"):
            return Acceptance(speculation="off" if info else "unknown", engine_reported=reported,
                              source="/get_server_info speculative_algorithm is null: no speculative decoding"
                              if info else "/get_server_info unavailable")
        figures = [r.spec for r in records if r.spec is not None and r.spec.num_verify_steps]
        steps = sum(f.num_verify_steps or 0 for f in figures)
        if figures and all(f.num_accepted_tokens is not None for f in figures):
            correct = sum(f.num_accepted_tokens or 0 for f in figures)
            proposed = (sum(f.num_draft_tokens or 0 for f in figures)
                        if all(f.num_draft_tokens for f in figures) else (steps * k if k else None))
            histograms = [f.acceptance_histogram for f in figures if f.acceptance_histogram]
            per_position = per_position_from_histograms(histograms) if len(histograms) == len(figures) else None
            return Acceptance(
                speculation="on", engine_reported=reported, num_speculative_tokens=k,
                source=f"SGLang per-request sglext.spec_tokens_details of {len(figures)} requests: "
                       "1 + sum(spec_num_correct_drafts) / sum(spec_verify_ct); rate = correct / proposed drafts; "
                       "per position from the summed spec_correct_drafts_histogram",
                num_verify_steps=steps, num_accepted_tokens=correct, num_draft_tokens=proposed,
                mean_acceptance_length=1 + correct / steps, acceptance_rate=ratio(correct, proposed),
                per_position_acceptance_rate=per_position)
        verify = _delta(before, after, "sglang:spec_verify_calls_total")
        tokens = _delta(before, after, "sglang:generation_tokens_total")
        if verify:
            length = ratio(tokens, verify)
            return Acceptance(
                speculation="on", engine_reported=reported, num_speculative_tokens=k,
                source="SGLang counters: delta sglang:generation_tokens_total / delta sglang:spec_verify_calls_total "
                       "(tokens per verify step; counts each request's first token from prefill, so slightly high); "
                       "rate = (length - 1) / k",
                num_verify_steps=round(verify), mean_acceptance_length=length,
                acceptance_rate=None if length is None or not k else (length - 1) / k)
        return Acceptance(speculation="on", engine_reported=reported, num_speculative_tokens=k,
                          source="SGLang returned no per-request figures and has no verify counter: no run delta "
                                 "(its gauges cover only the last log window)")


def _first_state(info: dict[str, Any] | None) -> dict[str, Any]:
    states = (info or {}).get("internal_states") or [{}]
    return states[0] if isinstance(states, list) and states and isinstance(states[0], dict) else {}
