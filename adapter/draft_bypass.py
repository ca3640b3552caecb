"""The draft fail-safe: when the draft stops matching the target, the engine stops drafting.

A draft whose acceptance collapsed (the seed's story: 0.20 for days) makes every step slower than the target alone:
each step still runs the draft k times and verifies k tokens that are then thrown away. The acceptance alarm says
so from the API server, where nothing can be switched; this runs in the engine core, inside vLLM's scheduler, and
acts. It uses vLLM's own dynamic speculative decoding: the scheduler looks the number of draft tokens up per step
(`Scheduler.dynamic_sd_lookup`, batch size -> k, which a `num_speculative_tokens_per_batch_size` schedule fills),
and a lookup of zeros schedules none.

A step that schedules k=0, bypassed or because a `num_speculative_tokens_per_batch_size` schedule says 0 for this
batch size, still runs the draft's first pass over every new token in vLLM 0.32 (`llm_base_proposer.propose`
returns after it, to keep the draft's KV cache in step), so that such a step costs more than the target alone's
(BENCHMARKS.md: a schedule's k=0 under `kimi-eagle bench tune`, a bypassed random draft under `kimi-eagle bench
bypass`). Where the runner does its bookkeeping synchronously (no async scheduling: every CPU engine), such a step
tells the worker to skip the draft and the engine's round trip for its drafts altogether, and a step with no drafts
left to verify runs as the target alone's would (no spec-decode metadata, no rejection sampler, no slot mapping or
attention metadata for the draft's layers), so that a bypassed engine costs what `--no-draft` costs. The draft's KV
cache then misses the tokens of those steps: a request that goes on after them drafts from a context with holes (the
crossing load of `kimi-eagle bench tune` measures what that costs), and a retry judges the draft only on requests
admitted after the retry began, whose draft KV cache is whole.

States: drafting -> (accepted / drafted tokens over `KIMI_EAGLE_ALARM_WINDOW_DRAFTS` drafts below
`KIMI_EAGLE_ALARM_MIN_RATE`) -> bypassed -> (every `KIMI_EAGLE_BYPASS_RETRY_S` seconds) retrying, the configured
lookup restored for one window of drafts -> drafting again if acceptance recovered, else bypassed.

The API server learns the state from the stats vLLM already sends it each step: while bypassed, the engine sends a
spec-decoding record with no drafts (vLLM sends none for a step without drafts), which `acceptance_alarm` turns
into the gauge `kimi_eagle:draft_bypassed`: on the first step after the switch, then once every `REPORT_EVERY_S`
(a record is built, sent and read on the step's own path, and the gauge needs the state, not every step).
"""

from __future__ import annotations

import contextlib
import enum
import logging
import math
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace

from kimi_eagle import envs
from kimi_eagle.adapter import compat, measured_k, surface
from kimi_eagle.adapter.acceptance_alarm import AcceptanceWindow
from kimi_eagle.adapter.runners import model_runner

logger = logging.getLogger("vllm.kimi_eagle")


class State(enum.Enum):
    DRAFTING = "drafting"
    BYPASSED = "bypassed"
    RETRYING = "retrying"


RETRY_TIMEOUT_S = 60.0  # a retry that sees no full window of new requests' drafts in this long ends, bypassed
REPORT_EVERY_S = 1.0  # while bypassed, how often the engine tells the API server so


class DraftBypass:
    """Decides from each step's drafted and accepted tokens whether the next steps draft."""

    def __init__(self, window_drafts: int, min_rate: float, retry_every_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.window = AcceptanceWindow(window_drafts)
        self.min_rate = min_rate
        self.retry_every_s = retry_every_s
        self.clock = clock
        self.state = State.DRAFTING
        self.bypassed_at = self.retry_started_at = 0.0
        self.bypasses = 0
        self._fresh: set[str] = set()  # requests admitted since the retry began
        self._step = [0, 0, 0]
        self._reported_at = -math.inf

    def report_due(self) -> bool:
        """Whether this step's stats should carry the record that says the engine is bypassed: from the first step
        after the switch that verified no drafts, then once every `REPORT_EVERY_S` while it stays so (an API server
        that missed one hears it again)."""
        return not self.drafting and self.clock() - self._reported_at >= REPORT_EVERY_S

    def reported(self) -> None:
        self._reported_at = self.clock()

    @property
    def drafting(self) -> bool:
        return self.state is not State.BYPASSED

    def admitted(self, request_id: str) -> None:
        if self.state is State.RETRYING:
            self._fresh.add(request_id)

    def count_draft(self, request_id: str, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """One request's verified draft in the current step (vLLM's own count: `make_spec_decoding_stats`)."""
        if self.state is State.RETRYING and request_id not in self._fresh:
            return
        self._step[0] += 1
        self._step[1] += num_draft_tokens
        self._step[2] += num_accepted_tokens

    def end_step(self) -> None:
        drafts, tokens, accepted = self._step
        self._step = [0, 0, 0]
        # While bypassed, drafts proposed before the switch are still verified in the next step: not a retry.
        if self.state is State.BYPASSED or not drafts:
            return
        self.window.add(drafts, tokens, accepted)
        if (rate := self.window.rate()) is None:
            return
        if rate < self.min_rate:
            self._bypass(f"the retry accepted {100 * rate:.1f}% of drafted tokens over {self.window.drafts} drafts")
        elif self.state is State.RETRYING:
            self.state = State.DRAFTING
            self._fresh.clear()
            logger.warning("kimi-eagle: draft fail-safe: the draft's acceptance recovered (%.1f%% of drafted tokens "
                           "over %d drafts, mean acceptance length %.2f): speculation resumed",
                           100 * rate, self.window.drafts, self.window.mean_acceptance_length())

    def before_schedule(self) -> None:
        now = self.clock()
        if self.state is State.BYPASSED and self.retry_every_s > 0 and now - self.bypassed_at >= self.retry_every_s:
            self.state = State.RETRYING
            self.retry_started_at = now
            self.window.clear()
            logger.info("kimi-eagle: draft fail-safe: retrying the draft on the next %d drafts of new requests",
                        self.window.window_drafts)
        elif self.state is State.RETRYING and now - self.retry_started_at >= RETRY_TIMEOUT_S:
            self._bypass(f"the retry saw {self.window.drafts} drafts of new requests in {RETRY_TIMEOUT_S:g} s, "
                         f"fewer than a window of {self.window.window_drafts}")

    def _bypass(self, retry_result: str) -> None:
        w = self.window
        retry = (f"it is tried again every {self.retry_every_s:g} s ({envs.BYPASS_RETRY_S.name})"
                 if self.retry_every_s > 0 else f"it is not tried again ({envs.BYPASS_RETRY_S.name}=0)")
        if self.state is State.RETRYING:
            logger.info("kimi-eagle: draft fail-safe: %s: still bypassed; %s", retry_result, retry)
        else:
            rate = w.accepted / w.draft_tokens
            logger.warning(
                "kimi-eagle: DRAFT BYPASSED: %d of %d drafted tokens accepted (%.1f%%, below %.1f%%) over the last "
                "%d drafts (mean acceptance length %.2f): the draft does not match this target, so the engine now "
                "serves without drafting, at the target's own speed; %s. Run `kimi-eagle doctor DRAFT --target "
                "TARGET --probe` to find out why.", w.accepted, w.draft_tokens, 100 * rate, 100 * self.min_rate,
                w.drafts, w.mean_acceptance_length(), retry)
        self.state = State.BYPASSED
        self.bypassed_at = self.clock()
        self.bypasses += 1
        self._reported_at = -math.inf
        self._fresh.clear()
        w.clear()


def unavailable_reason(vllm_config) -> str | None:
    """Why the fail-safe cannot switch k on this engine, or None when it can."""
    spec = vllm_config.speculative_config
    if vllm_config.parallel_config.data_parallel_size > 1:
        # vLLM turns its own schedule off under data parallelism for the same reason.
        return ("data parallelism: ranks that pick different numbers of draft tokens diverge and deadlock "
                "(vLLM disables its own schedule there)")
    from vllm.platforms import current_platform

    if current_platform.is_cpu() or vllm_config.model_config.enforce_eager:
        return None
    schedule = spec.num_speculative_tokens_per_batch_size
    if schedule and any(int(k) == 0 for _, _, k in schedule):
        return None  # vLLM prepared its CUDA graphs for every k of the schedule, 0 among them
    return ("vLLM captures CUDA graphs for the verification lengths it expects at start, and k=0 is not among "
            "them: give the speculative config a `num_speculative_tokens_per_batch_size` schedule with a 0 in "
            "it, or --enforce-eager")


def _zero_draft_stats(num_spec_tokens: int):
    from vllm.v1.spec_decode.metrics import SpecDecodingStats

    return SpecDecodingStats.new(num_spec_tokens)


_SCHEDULER = "vllm.v1.core.sched.scheduler"
_RUNNER = "vllm.v1.worker.gpu_model_runner"
SLOW_DRAFT_S = 0.015
SKIP_DRAFT = "kimi_eagle_skip_draft"  # set on a SchedulerOutput (pickled with it to the worker): run no draft


def install() -> bool:
    """Wrap vLLM's `Scheduler` and `EngineCore` (engine core process) and its model runner (worker)."""
    if not compat.supported():
        return False
    _install_scheduler()
    _install_runner()
    return True


def _install_scheduler() -> None:
    up = SimpleNamespace()  # vLLM's own methods, as each is wrapped

    def init(self, *args, **kwargs):
        up.init(self, *args, **kwargs)
        self._kimi_eagle_bypass = self._kimi_eagle_measured = self._kimi_eagle_step = None
        self._kimi_eagle_skip = self._kimi_eagle_skipped = False
        spec = self.vllm_config.speculative_config
        if spec is None or not spec.use_eagle() or self.num_spec_tokens <= 0:
            return
        if reason := unavailable_reason(self.vllm_config):
            logger.warning("kimi-eagle: draft fail-safe off: %s. The acceptance alarm still watches.", reason)
            return
        # With async scheduling the runner's next step reads bookkeeping that the draft pass writes: keep vLLM's
        # own k=0 there (the draft still runs its first pass); skip the draft only where bookkeeping is synchronous,
        # on the runner whose steps the skip is written for (V1's; V2 reads k per step from the scheduler, and
        # pads the verification of a k=0 step on its own).
        runner = model_runner(self.vllm_config)
        self._kimi_eagle_skip = not self.scheduler_config.async_scheduling and runner == "V1"
        if runner != "V1":
            logger.info("kimi-eagle: draft fail-safe on Model Runner %s: the scheduler schedules no draft tokens "
                        "while bypassed; the draft's own pass still runs each step on this runner (the plain-step "
                        "shortcut is Model Runner V1's)", runner)
        self._kimi_eagle_lookup = self.dynamic_sd_lookup  # the configured schedule (None: k always)
        self._kimi_eagle_zeros = [0] * (self.scheduler_config.max_num_seqs + 1)
        if envs.runtime_checks() and envs.bypass_enabled():
            self._kimi_eagle_bypass = DraftBypass(envs.alarm_window_drafts(), envs.alarm_min_rate(),
                                                  envs.bypass_retry_s())
        self._kimi_eagle_measured = measured_k.for_scheduler(self)

    def add_request(self, request, *args, **kwargs):
        if self._kimi_eagle_bypass is not None:
            self._kimi_eagle_bypass.admitted(request.request_id)
        return up.add(self, request, *args, **kwargs)

    def schedule(self, *args, **kwargs):
        bypass, measured = self._kimi_eagle_bypass, self._kimi_eagle_measured
        if bypass is not None:
            bypass.before_schedule()
        # The fail-safe first (zeros while bypassed, the profile's schedule while it retries), then the measured k.
        measuring = measured is not None and (bypass is None or bypass.state is State.DRAFTING)
        if measuring:
            self.dynamic_sd_lookup = measured.lookup
        elif bypass is not None:
            self.dynamic_sd_lookup = self._kimi_eagle_lookup if bypass.drafting else self._kimi_eagle_zeros
        started = time.perf_counter()
        output = up.schedule(self, *args, **kwargs)
        self._kimi_eagle_step = measured_k.decode_step(output, started) if measuring else None
        # A probe of k = 0 keeps the draft's own pass: a plain step leaves a hole in the draft's KV cache, and the
        # requests in flight would draft from it for the rest of their lives, at a fraction of the speed-up
        # (BENCHMARKS.md, the engine's measured k). The probe then times vLLM's own k = 0, a little slower than a
        # plain step.
        probing_plain = measuring and measured.probing_no_draft(len(output.num_scheduled_tokens))
        self._kimi_eagle_skipped = (self._kimi_eagle_skip and output.total_num_scheduled_tokens > 0
                                    and output.num_spec_tokens_to_schedule == 0 and not probing_plain)
        if self._kimi_eagle_skipped:
            setattr(output, SKIP_DRAFT, True)
        return output

    def make_spec_decoding_stats(self, spec_decoding_stats, num_draft_tokens, num_accepted_tokens,
                                 num_invalid_spec_tokens, request_id):
        if num_draft_tokens and (self._kimi_eagle_bypass is not None or self._kimi_eagle_measured is not None):
            drafted = num_draft_tokens - (num_invalid_spec_tokens or {}).get(request_id, 0)
            if self._kimi_eagle_bypass is not None:
                self._kimi_eagle_bypass.count_draft(request_id, drafted, num_accepted_tokens)
            if self._kimi_eagle_measured is not None:
                self._kimi_eagle_measured.count_draft(drafted, num_accepted_tokens)
        return up.count(self, spec_decoding_stats, num_draft_tokens, num_accepted_tokens,
                              num_invalid_spec_tokens, request_id)

    def update_from_output(self, scheduler_output, model_runner_output):
        outputs = up.update(self, scheduler_output, model_runner_output)
        if self._kimi_eagle_step is not None:
            self._kimi_eagle_measured.observe_step(self._kimi_eagle_step, time.perf_counter())
        bypass, measured = self._kimi_eagle_bypass, self._kimi_eagle_measured
        if bypass is not None:
            bypass.end_step()
            if bypass.report_due():
                for eco in outputs.values():
                    stats = eco.scheduler_stats
                    # A step that still verified drafts proposed before the switch sends vLLM's own record.
                    if stats is not None and stats.spec_decoding_stats is None:
                        stats.spec_decoding_stats = _zero_draft_stats(self.num_spec_tokens)
                        bypass.reported()
        # While bypassed the measured k waits, and the API server's gauges keep its last report. The last step before
        # the engine goes idle reports too: what a load run leaves is then on /metrics when it ends.
        if (measured is not None and (bypass is None or bypass.state is State.DRAFTING)
                and (measured.report_due() or not self.has_unfinished_requests())):
            stats = next((eco.scheduler_stats for eco in outputs.values() if eco.scheduler_stats is not None), None)
            if stats is not None:  # else the next step's stats carry it
                if stats.spec_decoding_stats is None:
                    stats.spec_decoding_stats = _zero_draft_stats(self.num_spec_tokens)
                measured_k.attach_report(stats.spec_decoding_stats, measured.report())
        return outputs

    def post_step(self, model_executed: bool) -> None:
        # After every step vLLM asks the worker for its drafts, a round trip of its own; a skipped step made none.
        if not getattr(self.scheduler, "_kimi_eagle_skipped", False):
            up.post_step(self, model_executed)

    _wrap_all(up, [(_SCHEDULER, "Scheduler.__init__", "init", init),
                   (_SCHEDULER, "Scheduler.add_request", "add", add_request),
                   (_SCHEDULER, "Scheduler.schedule", "schedule", schedule),
                   (_SCHEDULER, "Scheduler.make_spec_decoding_stats", "count", make_spec_decoding_stats),
                   (_SCHEDULER, "Scheduler.update_from_output", "update", update_from_output),
                   ("vllm.v1.engine.core", "EngineCore.post_step", "post_step", post_step)])


def _wrap_all(up: SimpleNamespace, wrappers: list[tuple[str, str, str, Callable]]) -> None:
    """Each (module, attribute, name, wrapper): vLLM's original goes to `up.name`, the wrapper in its place."""
    for module, attribute, name, wrapper in wrappers:
        def make(original, name=name, wrapper=wrapper):
            setattr(up, name, original)
            return wrapper

        surface.wrap(module, attribute, make)


def _install_runner() -> None:
    import torch

    up = SimpleNamespace()
    slow_draft_s = SLOW_DRAFT_S if envs.fault() == "slow-draft" else 0.0
    if slow_draft_s:
        logger.warning("kimi-eagle: FAULT INJECTION %s=slow-draft: each draft token takes %g s longer",
                       envs.FAULT.name, slow_draft_s)

    def execute_model(self, scheduler_output, *args, **kwargs):
        # A skipped step with no drafts left to verify is a plain step: it runs as the target alone's (see
        # `_as_the_target_alone`).
        self._kimi_eagle_plain_step = (getattr(scheduler_output, SKIP_DRAFT, False)
                                       and not scheduler_output.scheduled_spec_decode_tokens)
        if not self._kimi_eagle_plain_step:
            return up.execute(self, scheduler_output, *args, **kwargs)
        with _as_the_target_alone(self):
            return up.execute(self, scheduler_output, *args, **kwargs)

    def sample_tokens(self, *args, **kwargs):
        if not getattr(self, "_kimi_eagle_plain_step", False):
            return up.sample_tokens(self, *args, **kwargs)
        with _as_the_target_alone(self):  # the same step's second half: the plain sampler, no draft to propose
            return up.sample_tokens(self, *args, **kwargs)

    def propose_draft_token_ids(self, scheduler_output, *args, **kwargs):
        if getattr(scheduler_output, SKIP_DRAFT, False):
            # What vLLM's own k=0 returns (no draft tokens for any request), without running the draft: the step
            # after the switch, which still verifies the drafts proposed before it.
            return torch.empty(len(self.input_batch.req_ids), 0, dtype=torch.int64, device=self.device)
        if slow_draft_s:  # a machine on which each draft token costs, for the tests of the measured k
            time.sleep(slow_draft_s * scheduler_output.num_spec_tokens_to_schedule)
        return up.propose(self, scheduler_output, *args, **kwargs)

    def compute_slot_mapping(self, num_reqs, query_start_loc, positions) -> None:
        # vLLM's loop over the KV-cache groups, less the draft's on a plain step: no draft writes its cache.
        skipped = getattr(self, "_kimi_eagle_skipped_groups", ())
        for gid, block_table in enumerate(self.block_tables):
            if gid not in skipped:
                block_table.compute_slot_mapping(num_reqs, query_start_loc, positions)

    _wrap_all(up, [(_RUNNER, "GPUModelRunner.execute_model", "execute", execute_model),
                   (_RUNNER, "GPUModelRunner.sample_tokens", "sample_tokens", sample_tokens),
                   (_RUNNER, "GPUModelRunner.propose_draft_token_ids", "propose", propose_draft_token_ids),
                   ("vllm.v1.worker.block_table", "MultiGroupBlockTable.compute_slot_mapping", "slot_mapping",
                    compute_slot_mapping)])


@contextlib.contextmanager
def _as_the_target_alone(runner) -> Iterator[None]:
    """A plain step without what a configured draft adds to it. With a draft configured, vLLM 0.32 spends every
    step on speculation, drafts or none: spec-decode metadata, the rejection sampler, slot mappings and attention
    metadata for the draft's layers (profiled on the tiny CPU pair: 3-4% of a bypassed step). It reads
    `speculative_config`, the attention groups and the reorder thresholds as each step runs: with the draft's part
    of them hidden for the step, the step takes the target alone's path."""
    if not hasattr(runner, "_kimi_eagle_target_attn_groups"):
        logger.info("kimi-eagle: steps that schedule no draft tokens now run as the target alone's (no draft, no "
                    "speculative metadata, the plain sampler)")
        draft_layers = getattr(runner.drafter, "_draft_attn_layer_names", set())
        runner._kimi_eagle_target_attn_groups = [
            [group for group in kv_group if not set(group.layer_names) <= draft_layers]
            for kv_group in runner.attn_groups]
        runner._kimi_eagle_draft_kv_groups = frozenset(
            gid for gid, group in enumerate(runner.kv_cache_config.kv_cache_groups)
            if group.layer_names and set(group.layer_names) <= draft_layers)
        runner._kimi_eagle_plain_thresholds = _plain_reorder_thresholds(runner._kimi_eagle_target_attn_groups,
                                                                        runner.reorder_batch_threshold)
    spec, attn_groups, block_table = runner.speculative_config, runner.attn_groups, runner.input_batch.block_table
    thresholds, runner_plain = runner._kimi_eagle_plain_thresholds
    runner_threshold = runner.reorder_batch_threshold
    spec_thresholds = [builder.reorder_batch_threshold for builder, _ in thresholds]
    runner.speculative_config, runner.attn_groups = None, runner._kimi_eagle_target_attn_groups
    block_table._kimi_eagle_skipped_groups = runner._kimi_eagle_draft_kv_groups
    for builder, plain in thresholds:
        builder.reorder_batch_threshold = plain
    runner.reorder_batch_threshold = runner_plain
    try:
        yield
    finally:
        runner.speculative_config, runner.attn_groups = spec, attn_groups
        block_table._kimi_eagle_skipped_groups = ()
        for (builder, _), threshold in zip(thresholds, spec_thresholds):
            builder.reorder_batch_threshold = threshold
        runner.reorder_batch_threshold = runner_threshold


def _plain_reorder_thresholds(target_attn_groups, runner_threshold: int | None) -> tuple[list, int | None]:
    """The target alone's reorder thresholds: (builder, its threshold) for each of the target's metadata builders
    whose threshold a draft raised, and the runner's, the lowest of the target's builders (vLLM's
    `calculate_reorder_batch_threshold`, which counted the draft's too). With a draft, vLLM raises a builder's
    "decode" query length from its class's 1 to 1 + k (`_init_reorder_batch_threshold`), and MLA's builder then
    splits every batch of one-token decodes the long way (`split_decodes_and_prefills` takes its shortcut for a
    uniform batch only at 1), where the target alone takes the shortcut."""
    raised, plain_values = [], []
    for kv_group in target_attn_groups:
        for group in kv_group:
            for builder in group.metadata_builders:
                threshold = builder.reorder_batch_threshold
                plain = getattr(type(builder), "reorder_batch_threshold", None)
                if isinstance(plain, int) and isinstance(threshold, int) and plain < threshold:
                    raised.append((builder, plain))
                    threshold = plain
                if threshold is not None:
                    plain_values.append(threshold)
    if not raised:
        return [], runner_threshold
    return raised, min(plain_values)
