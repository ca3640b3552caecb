"""`doctor --probe`, second half: offline acceptance through the real engine.

vLLM's own OpenAI server runs the pair: started here with the project's launcher (a profile, default
tiny-cpu-exact, with the doctor's target and draft, on a free port of 127.0.0.1), or already running at a URL the
user gives. The calibration prompts go to it over HTTP in greedy completions requests (temperature 0, a fixed
max_tokens), and vLLM's own Prometheus counters, read before and after, give the acceptance in the project's one
definition (`loadtest/engines.py`, whose reader is reused): mean acceptance length = 1 + accepted / drafts,
per-position rate i = drafts whose token i was accepted / drafts. A server doctor starts is stopped on every way
out (Ctrl-C and SIGTERM included).

With `--probe-url` the delta counts every request the server finished meanwhile: give a server nobody else uses.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from pydantic import BaseModel, Field
from rich.table import Table

from kimi_eagle import envs
from kimi_eagle.acceptance import Acceptance
from kimi_eagle.checks import Finding, Severity
from kimi_eagle.doctor.probe import ProbeError
from kimi_eagle.processes import free_port, sigterm_as_keyboard_interrupt

MAX_TOKENS = 64
# The plugin's alarm threshold (ACCEPTANCE COLLAPSE in the server log): one meaning of "accepts almost nothing".
LOW_ACCEPTANCE_RATE = float(envs.ALARM_MIN_RATE.default)
READY_TIMEOUT_S = 600  # vLLM takes 60-200 s to answer /health on a loaded 2-core machine
REQUEST_TIMEOUT_S = 600
PROMPTS_PER_REQUEST = 16  # the tiny-cpu profiles' --max-num-seqs: one batch per request


class EngineProbe(BaseModel):
    """Acceptance of the draft measured through vLLM, or why it was not measured."""

    skipped: str | None = Field(None, description="Why nothing was measured; None when it was.")
    skipped_fix: str | None = Field(None, description="What would let it run, when skipped.")
    server: str | None = Field(None, description="Which server: started by doctor (profile) or given (URL).")
    url: str | None = None
    model: str | None = Field(None, description="The served model name the prompts went to.")
    prompts: int | None = None
    max_tokens: int | None = Field(None, description="max_tokens of every prompt (greedy, temperature 0).")
    completion_tokens: int | None = Field(None, description="Tokens the server generated for all prompts.")
    seconds_to_ready: float | None = Field(None, description="Server start to /health 200 (None: already running).")
    seconds_generating: float | None = Field(None, description="The completions request, end to end.")
    acceptance: Acceptance | None = Field(None, description="From vLLM's spec_decode counters, after minus before.")

    def findings(self) -> list[Finding]:
        if self.skipped:
            return [Finding(code="engine-probe-skipped", severity=Severity.INFO, engine="vllm",
                            title="offline acceptance through vLLM was not measured", found=self.skipped,
                            expected="a vLLM server that runs this pair", fix=self.skipped_fix or "")]
        a = self.acceptance
        if a is None or a.acceptance_rate is None or a.acceptance_rate >= LOW_ACCEPTANCE_RATE:
            return []
        return [Finding(code="engine-acceptance-low", severity=Severity.WARNING, engine="vllm",
                        title="vLLM accepts almost none of the draft's tokens",
                        found=f"acceptance rate {a.acceptance_rate:.1%} ({a.num_accepted_tokens} of "
                              f"{a.num_draft_tokens} draft tokens), mean acceptance length "
                              f"{a.mean_acceptance_length:.2f}, greedy, {self.prompts} calibration prompts",
                        expected=f"well above {LOW_ACCEPTANCE_RATE:.0%} for a draft trained for this target",
                        fix="the draft gets other hidden states than it was trained on, or it is untrained or "
                            "trained for another target: see the findings above and the step-0 table")]


def measure(url: str, model: str | None, prompts: list[str], *, api_key: str | None = None,
            max_tokens: int = MAX_TOKENS) -> EngineProbe:
    """Send the prompts to the vLLM server at `url` (greedy) and read its acceptance counters around them."""
    import openai

    from kimi_eagle.loadtest.engines import EngineError, VllmReader

    reader = VllmReader(url, api_key=api_key)
    try:
        model = model or reader.served_model()
        before = reader.snapshot()
        if before.total("vllm:spec_decode_num_drafts_total") is None:
            raise ProbeError(f"the vLLM server at {reader.url} runs without speculative decoding (it exports no "
                             "vllm:spec_decode_* counters): serve the target with this draft")
        client = openai.OpenAI(base_url=f"{reader.url}/v1", api_key=api_key or "unused", timeout=REQUEST_TIMEOUT_S,
                               max_retries=0)
        started = time.monotonic()
        completion_tokens = 0
        # A few prompts per request: a long prompts file in one request would overrun the server's queue bound.
        for first in range(0, len(prompts), PROMPTS_PER_REQUEST):
            try:
                response = client.completions.create(model=model, prompt=prompts[first : first + PROMPTS_PER_REQUEST],
                                                     max_tokens=max_tokens, temperature=0)
            except openai.APIError as exc:
                raise ProbeError(f"the calibration prompts failed on {reader.url}: {exc}") from None
            completion_tokens += response.usage.completion_tokens if response.usage else 0
        generating = time.monotonic() - started
        after = reader.snapshot()
    except EngineError as exc:
        raise ProbeError(str(exc)) from None
    return EngineProbe(url=reader.url, model=model, prompts=len(prompts), max_tokens=max_tokens,
                       completion_tokens=completion_tokens,
                       seconds_generating=generating, acceptance=reader.acceptance(before, after, []))


def measure_on_running_server(url: str, prompts: list[str]) -> EngineProbe:
    """Acceptance on a server the user already runs (`--probe-url`); the key, if it wants one, from VLLM_API_KEY."""
    import os

    from kimi_eagle.serve.command import API_KEY_ENV

    result = measure(url, None, prompts, api_key=os.environ.get(API_KEY_ENV))
    result.server = "given (--probe-url)"
    return result


def measure_with_started_server(draft: Path, target: Path, prompts: list[str], profile_name: str) -> EngineProbe:
    """Start vLLM for the pair with `profile_name` on a free loopback port, measure, and stop it (always)."""
    from kimi_eagle.serve.command import CommandError, build_command
    from kimi_eagle.serve.launch import ServerStartError, running_server
    from kimi_eagle.serve.profile import ProfileError, load_profile

    try:
        command = build_command(load_profile(profile_name), target=str(target), draft=str(draft),
                                host="127.0.0.1", port=free_port())
    except (ProfileError, CommandError) as exc:
        raise ProbeError(str(exc)) from None
    # The server's log outlives a failed start, whose message points at it; a probe that ran removes it.
    log = Path(tempfile.mkstemp(prefix="kimi-eagle-doctor-", suffix=".log")[1])
    with sigterm_as_keyboard_interrupt():
        try:
            with running_server(command, log_path=log, timeout_s=READY_TIMEOUT_S) as ready_s:
                result = measure(command.url, command.served_model_name, prompts, api_key=command.api_key)
        except ServerStartError as exc:
            raise ProbeError(f"vLLM did not start for the pair (profile {profile_name}): {exc}") from None
    log.unlink(missing_ok=True)
    result.server = f"started by doctor: vLLM, profile {profile_name}"
    result.seconds_to_ready = ready_s
    return result


def acceptance_table(result: EngineProbe) -> Table:
    if result.skipped:
        table = Table(title="Offline acceptance through vLLM: [yellow]skipped[/]", expand=True)
        table.add_column("why", overflow="fold")
        table.add_column("fix", overflow="fold")
        table.add_row(result.skipped, result.skipped_fix or "")
        return table
    a = result.acceptance or Acceptance(speculation="unknown", source="not read")
    rates = a.per_position_acceptance_rate or []
    table = Table(title=f"Offline acceptance through vLLM (k={a.num_speculative_tokens}; {result.prompts} calibration "
                        f"prompts, greedy, max_tokens {result.max_tokens})", expand=True)
    for column in ("mean acceptance length", *(f"position {i}" for i in range(1, len(rates) + 1)),
                   "acceptance rate"):
        table.add_column(column)
    table.add_row(_figure(a.mean_acceptance_length, "{:.2f}"), *(f"{r:.1%}" for r in rates),
                  _figure(a.acceptance_rate, "{:.1%}"))
    table.caption = (f"{a.num_accepted_tokens} of {a.num_draft_tokens} draft tokens accepted in {a.num_verify_steps} "
                     f"verify steps; {result.completion_tokens} tokens generated in "
                     f"{_figure(result.seconds_generating, '{:.1f}')}s; {result.server} ({result.url}"
                     + (f", ready in {result.seconds_to_ready:.0f}s)" if result.seconds_to_ready is not None else ")"))
    return table


def _figure(value: float | None, form: str) -> str:
    return "unknown" if value is None else form.format(value)
