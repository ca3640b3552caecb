"""What one Locust process does around the users: set up, collect records, read the engine, write results.

Local and distributed modes give the same results: workers attach their new records to Locust's periodic
report to the master (`report_to_master` / `worker_report`), and only the master (or the single local process)
reads the engine and writes the results folder. When a distributed run ends, the master first drains the workers
(they stop their users, whose requests in flight finish, and send their last records) before Locust's own quit,
which waits only half a second for the workers' final reports and would drop the tail of the run.

Interrupted (Ctrl-C or SIGTERM, which Locust turns into its shutdown while users still run): the results gathered
so far are written all the same, `summary.json` says `interrupted: true`, and the exit code is 130.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Any

import gevent
import psutil
from locust.env import Environment
from locust.runners import (
    STATE_INIT,
    STATE_MISSING,
    STATE_RUNNING,
    STATE_SPAWNING,
    LocalRunner,
    MasterRunner,
    WorkerRunner,
)
from pydantic import ValidationError

from kimi_eagle.loadtest.engines import EngineError, EngineSnapshot, get_engine
from kimi_eagle.loadtest.prompts import PromptError
from kimi_eagle.loadtest.records import RequestRecord
from kimi_eagle.loadtest.summary import EXIT_INTERRUPTED, LocustSettings
from kimi_eagle.loadtest.user import STATE_KEY, RunState, run_state
from kimi_eagle.loadtest.workload import Workload, add_workload_options, workload_from_options

logger = logging.getLogger(__name__)
RECORDS_KEY = "kimi_records"
CPU_KEY = "kimi_cpu_percent"  # a worker's CPU use since its previous report (Locust's own figure starts after 20 s)
PROGRESS_INTERVAL_S = 2.0
DRAIN_MESSAGE = "kimi_eagle_drain"  # master -> worker: stop your users and send your last records
FINAL_RECORDS_MESSAGE = "kimi_eagle_final_records"  # worker -> master: those records
DRAIN_MARGIN_S = 15.0  # beyond --stop-timeout, for the messages themselves
def add_options(parser: Any) -> None:
    """Our options in Locust's own parser (not in a group: only the parser takes include_in_web_ui): they
    show in the web UI and reach the workers."""
    parser.add_argument("--engine", default="vllm", help="engine kind behind --host: vllm or sglang")
    add_workload_options(parser, unset="empty")
    parser.add_argument("--request-rate", type=float, default=0.0,
                       help="open loop: total Poisson arrival rate in req/s (0: closed loop)")
    parser.add_argument("--open-loop-users", type=int, default=0, include_in_web_ui=False,
                       help="users over all processes, to split --request-rate (0: this process's users)")
    parser.add_argument("--max-requests", type=int, default=0, help="requests per Locust process (0: no limit)")
    parser.add_argument("--results-dir", default="", help="write the results folder here when Locust quits")
    parser.add_argument("--label", default="", help="name of this run in reports")


def workload_from(environment: Environment) -> Workload:
    o = environment.parsed_options
    return workload_from_options(o, url=environment.host or "http://127.0.0.1:8000", engine=o.engine,
                                 request_rate_per_s=o.request_rate or None)


class Session:
    """Master-side (or local) bookkeeping of one run."""

    def __init__(self, environment: Environment, state: RunState) -> None:
        self.environment = environment
        self.state = state
        self.engine = get_engine(state.workload.engine, state.workload.url)
        self.before: EngineSnapshot | None = None
        self.after: EngineSnapshot | None = None
        self.cpu_max: float | None = None
        self.workers = 0
        self.started = time.monotonic()
        self._greenlets: list[gevent.Greenlet] = []
        self._quitting = False
        self._finished = False
        self._drained = False
        self.drained_workers: set[str] = set()

    def snapshot(self) -> EngineSnapshot | None:
        try:
            return self.engine.snapshot()
        except EngineError as exc:
            logger.warning("engine counters unavailable, acceptance will be unknown: %s", exc)
            return None

    def on_test_start(self) -> None:
        self.engine = get_engine(self.state.workload.engine, self.state.workload.url)
        runner = self.environment.runner
        self.workers = len(runner.clients) if isinstance(runner, MasterRunner) else 0
        self.before = self.snapshot()
        self.started = time.monotonic()
        self._drained, self.drained_workers = False, set()  # the web UI may start several tests in one session
        self.cpu_max = None
        self._greenlets = [gevent.spawn(self._progress)]
        if not isinstance(runner, MasterRunner):
            self._greenlets.append(gevent.spawn(self._sample_cpu))

    def _sample_cpu(self) -> None:
        """Local mode: this process's CPU use, each second. (Workers send theirs with their reports.)"""
        me = psutil.Process()
        me.cpu_percent(interval=None)
        while True:
            gevent.sleep(1.0)
            self.cpu_max = max(self.cpu_max or 0.0, me.cpu_percent(interval=None))

    def _progress(self) -> None:
        last_tokens, last_t = 0, time.monotonic()
        while True:
            gevent.sleep(PROGRESS_INTERVAL_S)
            records = self.state.records
            ok = [r for r in records if r.ok]
            tokens = sum(r.completion_tokens or 0 for r in ok)
            now = time.monotonic()
            rate = (tokens - last_tokens) / (now - last_t)
            last_tokens, last_t = tokens, now
            ttfts = sorted(r.ttft_ms for r in ok if r.ttft_ms is not None)
            ttft = f"{ttfts[len(ttfts) // 2]:.0f} ms" if ttfts else "n/a"
            runner = self.environment.runner
            self._stop_when_all_sent()
            sys.stderr.write(f"[{now - self.started:6.1f}s] users {runner.user_count if runner else 0} | "
                             f"{len(ok)} ok, {len(records) - len(ok)} failed | {rate:7.1f} tok/s | "
                             f"TTFT p50 {ttft} | cpu {'n/a' if self.cpu_max is None else f'{self.cpu_max:.0f}%'}\n")
            sys.stderr.flush()

    def _stop_when_all_sent(self) -> None:
        """With --max-requests, end the run once every process has had all its answers (not at --run-time)."""
        cap = self.state.max_requests
        processes = self.workers if isinstance(self.environment.runner, MasterRunner) else 1
        headless = getattr(self.environment.parsed_options, "headless", False)  # the web UI user decides
        if cap and processes and headless and not self._quitting and len(self.state.records) >= cap * processes:
            self._quitting = True
            gevent.spawn(self.environment.runner.quit)

    def drain_workers(self) -> None:
        """Distributed mode, at the end of a run: every worker stops its users (requests in flight finish, within
        --stop-timeout) and sends the records its periodic reports have not carried yet."""
        runner = self.environment.runner
        if not isinstance(runner, MasterRunner) or self._drained or self._finished:
            return  # after an interruption the results are already written: do not wait for anyone
        self._drained = True
        expected = {c.id for c in runner.clients.all if c.state != STATE_MISSING}
        for client_id in expected:
            runner.send_message(DRAIN_MESSAGE, None, client_id)
        wait_s = (self.environment.stop_timeout or 0.0) + DRAIN_MARGIN_S
        deadline = time.monotonic() + wait_s
        while not expected <= self.drained_workers and time.monotonic() < deadline:
            gevent.sleep(0.1)
        if missing := expected - self.drained_workers:
            logger.warning("%d of %d workers did not send their last records within %.0f s: the summary lacks "
                           "their final requests", len(missing), len(expected), wait_s)

    def on_final_records(self, client_id: str, records: list[dict[str, Any]]) -> None:
        self.state.records.extend(RequestRecord.model_validate(d) for d in records)
        self.drained_workers.add(client_id)

    def finish(self) -> int:
        """Write the results (when --results-dir is set) and return the exit code."""
        runner = self.environment.runner
        # Locust's shutdown (Ctrl-C, SIGTERM) fires `quitting` while users still run; a run that ended by itself
        # (--run-time, --max-requests, the web UI's stop) has stopped them first.
        interrupted = runner is not None and runner.state in (STATE_INIT, STATE_SPAWNING, STATE_RUNNING)
        self._finished = True
        for g in self._greenlets:
            g.kill(block=False)
        # Read the engine only now: in distributed mode the master's test_stop comes before the workers have
        # finished their last requests.
        if self.before is not None:
            self.after = self.snapshot()
        o = self.environment.parsed_options
        records = sorted(self.state.records, key=lambda r: r.start_unix_s)
        settings = LocustSettings(
            users=getattr(o, "num_users", None), spawn_rate_per_s=getattr(o, "spawn_rate", None),
            run_time_s=getattr(o, "run_time", None),
            mode="distributed" if isinstance(runner, MasterRunner) else "local",
            workers=self.workers)
        if o.results_dir:
            from kimi_eagle.loadtest.results import write_run

            summary = write_run(Path(o.results_dir), records=records, workload=self.state.workload,
                                locust=settings, model=self.state.model, engine=self.engine, before=self.before,
                                after=self.after, cpu_max=self.cpu_max, label=o.label or None,
                                interrupted=interrupted)
            sys.stderr.write(f"results{' so far (interrupted)' if interrupted else ''}: "
                             f"{o.results_dir}/summary.json, report.md\n")
            bad_tokens = summary.tokens.per_chunk_count_mismatches
        else:
            bad_tokens = 0
        if interrupted:
            return EXIT_INTERRUPTED
        failed = sum(not r.ok for r in records)
        if not records or failed or bad_tokens:
            logger.error("run not clean: %d requests, %d failed, %d with per-chunk token counts that disagree "
                         "with the server's usage", len(records), failed, bad_tokens)
            return 1
        return 0


SESSION_KEY = "kimi_eagle_session"


def _build_state(environment: Environment) -> RunState:
    runner = environment.runner
    worker = f"worker-{runner.client_id}" if isinstance(runner, WorkerRunner) else "local"
    try:
        return RunState.build(workload_from(environment), worker=worker,
                              max_requests=environment.parsed_options.max_requests or None,
                              offset_of=lambda: getattr(environment.runner, "worker_index", 0))
    except (EngineError, PromptError, ValidationError) as exc:
        raise SystemExit(f"kimi-eagle locustfile: {exc}") from None


def on_init(environment: Environment) -> None:
    if environment.parsed_options is None:
        return  # used as a library: the caller sets the state up
    runner = environment.runner
    setattr(environment, STATE_KEY, _build_state(environment))  # bad options fail here, before any user starts
    if isinstance(runner, WorkerRunner):
        me = psutil.Process()
        me.cpu_percent(interval=None)  # the first call only starts the measurement

        def attach(client_id: str, data: dict[str, Any]) -> None:
            state = run_state(environment)
            data[RECORDS_KEY], state.unsent = state.unsent, []
            data[CPU_KEY] = me.cpu_percent(interval=None)

        environment.events.report_to_master.add_listener(attach)

        def drain(environment: Environment, msg: Any, **_: Any) -> None:
            environment.runner.stop()  # returns once the users' requests in flight have finished
            state = run_state(environment)
            records, state.unsent = state.unsent, []
            environment.runner.send_message(FINAL_RECORDS_MESSAGE, {RECORDS_KEY: records})

        # concurrent: stopping the users takes as long as their last requests, and must not hold up heartbeats.
        runner.register_message(DRAIN_MESSAGE, drain, concurrent=True)
        # The master sends its options (the web UI form's too) with each new test: build the state again.
        environment.events.test_start.add_listener(
            lambda **_: setattr(environment, STATE_KEY, _build_state(environment)))
        return
    if not isinstance(runner, LocalRunner | MasterRunner):
        return
    session = Session(environment, run_state(environment))
    setattr(environment, SESSION_KEY, session)
    if isinstance(runner, MasterRunner):
        def collect(client_id: str, data: dict[str, Any]) -> None:
            session.state.records.extend(RequestRecord.model_validate(d) for d in data.get(RECORDS_KEY, []))
            if data.get(CPU_KEY) is not None:
                session.cpu_max = max(session.cpu_max or 0.0, float(data[CPU_KEY]))

        environment.events.worker_report.add_listener(collect)
        runner.register_message(FINAL_RECORDS_MESSAGE, lambda environment, msg, **_: session.on_final_records(
            msg.node_id, (msg.data or {}).get(RECORDS_KEY, [])))
        environment.events.test_stopping.add_listener(lambda **_: session.drain_workers())

    def start(**_: Any) -> None:
        session.state = _build_state(environment)  # the web UI may have changed the options or the host
        setattr(environment, STATE_KEY, session.state)
        session.on_test_start()

    environment.events.test_start.add_listener(start)
    # Where the exit code is set (Locust's own is 1 on any failure; ours also on token miscounts).
    environment.events.quitting.add_listener(lambda **_: _quit(environment, session))


def _quit(environment: Environment, session: Session) -> None:
    environment.process_exit_code = session.finish()
