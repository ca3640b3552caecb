"""What every measuring mode of `kimi-eagle bench` shares: its common options, the profile and prompts it measures
with, and the results files it writes (`OUT/<mode>-<time>.json` and `.md`; the servers' files in
`OUT/<mode>-<time>-files/`)."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel

if TYPE_CHECKING:
    from rich.console import Console

    from kimi_eagle.serve.profile import Profile

RESULTS_DIR = Path("bench") / "results"
DEFAULT_PROFILE = "tiny-cpu"
CHECKOUT = Path(__file__).resolve().parents[1]

R = TypeVar("R", bound=BaseModel)


class BenchError(RuntimeError):
    """The benchmark cannot run as asked, or had to stop; the message says why and how to fix it."""


def add_run_options(parser: argparse.ArgumentParser, *, quick: str, rounds: int | None = None) -> None:
    """The options of every measuring mode: `--quick` (what it does there), the profile and models, the prompts, the
    results folder; `--rounds` for the modes whose plan is rounds of the whole run (`rounds`: its default)."""
    parser.add_argument("--quick", action="store_true", help=quick)
    if rounds is not None:
        parser.add_argument("--rounds", type=_at_least_one, metavar="N",
                            help=f"rounds of the whole run (default {rounds}): more rounds, a narrower spread")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help=f"results folder (default {RESULTS_DIR})")
    parser.add_argument("--profile", default=DEFAULT_PROFILE, help=f"serving profile (default {DEFAULT_PROFILE})")
    parser.add_argument("--target", help="target checkpoint instead of the profile's")
    parser.add_argument("--draft", help="EAGLE-3 draft instead of the profile's")
    parser.add_argument("--prompts", type=Path,
                        help="JSON list of prompt strings (default: the fixtures' held-out prompts)")


def _at_least_one(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number of rounds, 1 or more")
    return value


def plan_of(full: R, quick: R, args: argparse.Namespace) -> R:
    """The mode's FULL or QUICK plan (--quick), with the rounds --rounds asks for where the mode has that option."""
    plan = quick if args.quick else full
    rounds = getattr(args, "rounds", None)
    return plan if rounds is None else plan.model_copy(update={"rounds": rounds})


def load_prompts(path: Path) -> list[str]:
    if not path.is_file():
        raise BenchError(f"no held-out prompts at {path}: they are written with the trained pair "
                         f"(`kimi-eagle fixtures --rebuild`), or give --prompts FILE (a JSON list of strings)")
    try:
        prompts = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise BenchError(f"{path} is not JSON ({exc}): give a JSON list of prompt strings") from None
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) and p.strip() for p in prompts):
        raise BenchError(f"{path} must be a non-empty JSON list of non-empty prompt strings")
    return prompts


def within_checkout(path: Path) -> str:
    """A path of the checkout relative to its root (results are committed and read on other machines); any other
    path as given."""
    resolved = Path(path).resolve()
    return str(resolved.relative_to(CHECKOUT)) if resolved.is_relative_to(CHECKOUT) else str(path)


@dataclass
class MeasuringRun:
    """One run of a measuring mode: the profile and prompts it measures with, the name of its files."""

    args: argparse.Namespace
    profile: Profile
    prompts_file: Path
    prompts: list[str]
    name: str  # <the plan's mode>-<start time>: the stem of every file the run writes
    console: Console

    @classmethod
    def start(cls, args: argparse.Namespace, plan_mode: str) -> MeasuringRun:
        """The profile (which must have a draft, or --draft) and the prompts, loaded and checked before any server
        starts; raises ProfileError or BenchError."""
        from rich.console import Console

        from kimi_eagle.fixtures.pair_spec import HELDOUT_PROMPTS_FILE
        from kimi_eagle.serve.profile import load_profile

        profile = load_profile(args.profile)
        if not (args.draft or profile.draft):
            raise BenchError(f"profile {profile.name} has no draft: give --draft DIR")
        prompts_file = args.prompts or HELDOUT_PROMPTS_FILE
        return cls(args=args, profile=profile, prompts_file=prompts_file, prompts=load_prompts(prompts_file),
                   name=f"{plan_mode}-{time.strftime('%Y%m%d-%H%M%S')}", console=Console(stderr=True))

    @property
    def files_dir(self) -> Path:
        return self.args.out / f"{self.name}-files"

    @property
    def bench_options(self) -> dict[str, Any]:
        """The keyword arguments every mode's bench class takes besides its plan and profile."""
        return {"target": self.args.target, "draft": self.args.draft, "prompts": self.prompts,
                "files_dir": self.files_dir, "command_line": self.args.command_line, "say": self.console.print}

    def write(self, result: R, markdown: Callable[[R], str]) -> Path:
        """The results as OUT/<name>.json and the report as OUT/<name>.md; returns the JSON file."""
        from kimi_eagle.loadtest.files import write_atomic, write_model

        json_path = write_model(self.args.out / f"{self.name}.json", result)
        md_path = write_atomic(self.args.out / f"{self.name}.md", markdown(result))
        self.console.print(f"results: {json_path}, {md_path}")
        return json_path
