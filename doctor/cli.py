"""`kimi-eagle doctor DRAFT [--target DIR] [--probe [--probe-url URL | --probe-profile P | --agreement-only]] [--json]`:
everything that is wrong with a draft, at once.

`--probe` runs both dynamic checks: the draft's step-0 agreement with the target for several sets of aux layer ids
(the target in transformers, seconds; doctor/probe.py) and the offline acceptance through vLLM itself (a server
started for the pair, or the one at --probe-url; doctor/engine_probe.py). Each is skipped, with the reason in the
report, where the target does not fit this machine.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kimi_eagle.checks import Finding
    from kimi_eagle.doctor.engine_probe import EngineProbe
    from kimi_eagle.doctor.probe import ProbeResult

DEFAULT_PROBE_PROFILE = "tiny-cpu-exact"  # float32: acceptance of the draft, not of bf16 rounding


def register(sub: argparse._SubParsersAction) -> None:
    """Add `doctor` to `kimi-eagle`."""
    p = sub.add_parser("doctor", help="check an EAGLE-3 draft (and its target) before serving it",
                       description="Static checks of an EAGLE-3 draft against its target for vLLM 0.32 and SGLang "
                                   "0.5.23: key coverage, shapes, aux layer ids, vocabulary maps, weight health, "
                                   "trained or not. --probe also runs the target on calibration prompts: which aux "
                                   "layer ids the draft agrees with best (transformers), and the mean and per-position "
                                   "acceptance through vLLM itself (a server it starts and stops, or --probe-url). "
                                   "Exit status: 0 all good, 1 warnings, 2 refusals.")
    p.add_argument("draft", type=Path, help="the draft's folder (speculators format, or a flat EAGLE-3 config)")
    p.add_argument("--target", type=Path, help="the target's folder (config.json and safetensors headers are read)")
    p.add_argument("--engine", choices=("all", "vllm", "sglang"), default="all",
                   help="judge for this engine only (default: both)")
    p.add_argument("--probe", action="store_true",
                   help="run the target on calibration prompts: the draft's step-0 agreement per set of aux ids, "
                        "and the acceptance through vLLM (needs --target; tiny models only on a CPU)")
    p.add_argument("--probe-url", metavar="URL",
                   help="measure the acceptance on this running vLLM server (serving this target with this draft, "
                        "used by nobody else meanwhile) instead of starting one; implies --probe. A key from "
                        "VLLM_API_KEY")
    p.add_argument("--probe-profile", metavar="PROFILE",
                   help="the serving profile of the vLLM server --probe starts (default tiny-cpu-exact: float32, so "
                        "that acceptance measures the draft, not bf16 rounding), with this --target and draft; "
                        "implies --probe")
    p.add_argument("--agreement-only", action="store_true",
                   help="--probe without vLLM: only the step-0 agreement (seconds instead of minutes); implies --probe")
    p.add_argument("--prompts", type=Path, help="calibration prompts for --probe: a text file, one prompt a line")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(handler=run_doctor)


def run_doctor(args: argparse.Namespace) -> int:
    from rich.console import Console

    from kimi_eagle.checks import diagnose
    from kimi_eagle.cpu_kernels import kernel_report
    from kimi_eagle.doctor.report import exit_code, print_report

    args.probe = args.probe or bool(args.probe_url or args.probe_profile or args.agreement_only)
    if args.agreement_only and (args.probe_url or args.probe_profile):
        print("kimi-eagle doctor: --agreement-only runs no vLLM server: drop --probe-url / --probe-profile",
              file=sys.stderr)
        return 2
    if args.probe_url and args.probe_profile:
        print("kimi-eagle doctor: --probe-url uses a running server, --probe-profile starts one: give one of them",
              file=sys.stderr)
        return 2
    if args.probe and args.target is None:
        print("kimi-eagle doctor: --probe needs --target DIR (the probe runs the target)", file=sys.stderr)
        return 2
    diagnosis = diagnose(args.draft, args.target)
    probe = engine = None
    if args.probe:
        from kimi_eagle.doctor.probe import ProbeError

        try:
            probe, engine, skipped = run_probes(args, refused_for_vllm=exit_code(diagnosis.findings, "vllm") == 2)
        except ProbeError as exc:
            print(f"kimi-eagle doctor --probe: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print("kimi-eagle doctor --probe: interrupted (any vLLM server it started is stopped)", file=sys.stderr)
            return 130
        diagnosis.findings.extend([*skipped, *(probe.findings() if probe else []),
                                  *(engine.findings() if engine else [])])
    code = exit_code(diagnosis.findings, args.engine)
    machine = kernel_report()  # which of vLLM's kernel builds serves here: a figure measured elsewhere may differ
    if args.json:
        report = diagnosis.model_dump(mode="json")
        report["machine"] = machine.as_dict() if machine else None
        report["model_runner"] = model_runner_report()
        report["probe"] = probe.model_dump(mode="json") if probe else None
        report["engine_probe"] = engine.model_dump(mode="json") if engine else None
        report["exit_code"] = code
        print(json.dumps(report, indent=1))
        return code
    console = Console(width=max(Console().width, 160))
    print_report(diagnosis, console, args.engine, machine)
    if probe:
        from kimi_eagle.doctor.probe import probe_table

        console.print(probe_table(probe))
    if engine:
        from kimi_eagle.doctor.engine_probe import acceptance_table

        console.print(acceptance_table(engine))
    console.print({0: "[green]all good[/]", 1: "[yellow]warnings[/] (exit 1)",
                   2: "[bold red]refusals[/]: serving would stop (exit 2)"}[code])
    return code


def model_runner_report() -> dict:
    """`--json`'s `model_runner`: the runner vLLM picks here, and each guard's reach on each runner."""
    from kimi_eagle.adapter.runners import runner_here
    from kimi_eagle.adapter.surface import FEATURES, hooks

    runner, why = runner_here()
    return {"here": runner, "why": why,
            "guards": [{"key": f.key, "name": f.name, "hooks": [t.key for t in hooks(f)], "V1": f.v1, "V2": f.v2}
                       for f in FEATURES]}


def run_probes(args: argparse.Namespace,
               refused_for_vllm: bool) -> tuple[ProbeResult | None, EngineProbe | None, list[Finding]]:
    """Step-0 agreement (None when the target does not fit here), then the acceptance through vLLM (None with
    --agreement-only), and a finding for a skipped step-0. Each part that cannot run on this machine is skipped with
    its reason; a ProbeError is a fault of the pair or of the input."""
    from kimi_eagle.checks import Finding, Severity
    from kimi_eagle.doctor.calibration import CalibrationError, calibration_prompts
    from kimi_eagle.doctor.probe import ProbeError, TargetTooBigError, probe_aux_ids

    try:
        prompts = calibration_prompts(args.prompts)
    except CalibrationError as exc:
        raise ProbeError(str(exc)) from None
    skipped: list[Finding] = []
    try:
        probe = probe_aux_ids(args.draft, args.target, prompts_file=args.prompts)
    except TargetTooBigError as exc:
        probe = None
        skipped.append(Finding(code="probe-skipped", severity=Severity.INFO,
                               title="the step-0 agreement of the aux layer ids was not measured", found=str(exc),
                               expected="a target that runs in transformers on this machine",
                               fix="run doctor --probe where the target fits (its acceptance through vLLM does "
                                   "not need this: --probe-url)"))
    return probe, engine_probe(args, prompts, refused_for_vllm), skipped


def engine_probe(args: argparse.Namespace, prompts: list[str], refused_for_vllm: bool) -> EngineProbe | None:
    """The acceptance through vLLM: on the server at --probe-url, or on one started for the pair; None with
    --agreement-only; skipped (with why) where the target does not fit here or the static checks refuse the draft."""
    from kimi_eagle.doctor.engine_probe import EngineProbe, measure_on_running_server, measure_with_started_server
    from kimi_eagle.doctor.probe import TargetTooBigError, check_runnable_here

    if args.agreement_only:
        return None
    if args.probe_url:
        return measure_on_running_server(args.probe_url, prompts)
    try:
        check_runnable_here(args.target)
    except TargetTooBigError as exc:
        return EngineProbe(skipped=str(exc), skipped_fix="run doctor --probe where the target fits, or give "
                                                         "--probe-url of a vLLM server that serves this pair")
    if refused_for_vllm:
        return EngineProbe(skipped="the static checks refuse this draft for vLLM (see Findings): our plugin would "
                                   "stop the engine at start", skipped_fix="fix the refusals first")
    return measure_with_started_server(args.draft, args.target, prompts, args.probe_profile or DEFAULT_PROBE_PROFILE)
