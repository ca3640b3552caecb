"""`kimi-eagle doctor DRAFT [--target DIR] [--probe] [--json]`: everything that is wrong with a draft, at once."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    """Add `doctor` to `kimi-eagle`."""
    p = sub.add_parser("doctor", help="check an EAGLE-3 draft (and its target) before serving it",
                       description="Static checks of an EAGLE-3 draft against its target for vLLM 0.32 and SGLang "
                                   "0.5.23: key coverage, shapes, aux layer ids, vocabulary maps, weight health, "
                                   "trained or not. --probe also runs the target on calibration prompts and measures "
                                   "which aux layer ids the draft agrees with best. Exit status: 0 all good, "
                                   "1 warnings, 2 refusals.")
    p.add_argument("draft", type=Path, help="the draft's folder (speculators format, or a flat EAGLE-3 config)")
    p.add_argument("--target", type=Path, help="the target's folder (config.json and safetensors headers are read)")
    p.add_argument("--engine", choices=("all", "vllm", "sglang"), default="all",
                   help="judge for this engine only (default: both)")
    p.add_argument("--probe", action="store_true",
                   help="run the target on calibration prompts and measure the draft's step-0 agreement "
                        "(needs --target; tiny models only on a CPU)")
    p.add_argument("--prompts", type=Path, help="calibration prompts for --probe: a text file, one prompt a line")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(handler=run_doctor)


def run_doctor(args: argparse.Namespace) -> int:
    from rich.console import Console

    from adapter.checks import diagnose
    from doctor.report import exit_code, print_report

    if args.probe and args.target is None:
        print("kimi-eagle doctor: --probe needs --target DIR (the probe runs the target)", file=sys.stderr)
        return 2
    diagnosis = diagnose(args.draft, args.target)
    probe = None
    if args.probe:
        from doctor.probe import ProbeError, probe_aux_ids

        try:
            probe = probe_aux_ids(args.draft, args.target, prompts_file=args.prompts)
        except ProbeError as exc:
            print(f"kimi-eagle doctor --probe: {exc}", file=sys.stderr)
            return 2
        diagnosis.findings.extend(probe.findings())
    code = exit_code(diagnosis.findings, args.engine)
    if args.json:
        report = diagnosis.model_dump(mode="json")
        report["probe"] = probe.model_dump(mode="json") if probe else None
        report["exit_code"] = code
        print(json.dumps(report, indent=1))
        return code
    console = Console(width=max(Console().width, 160))
    print_report(diagnosis, console, args.engine)
    if probe:
        from doctor.probe import probe_table

        console.print(probe_table(probe))
    console.print({0: "[green]all good[/]", 1: "[yellow]warnings[/] (exit 1)",
                   2: "[bold red]refusals[/]: serving would stop (exit 2)"}[code])
    return code
