"""What a check reports: one finding per fault, with what was found, what was expected and how to fix it."""

from __future__ import annotations

from enum import IntEnum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Engine = Literal["all", "vllm", "sglang"]


class Severity(IntEnum):
    INFO = 0
    WARNING = 1
    REFUSAL = 2


class Finding(BaseModel):
    model_config = ConfigDict(frozen=True)

    code: str = Field(description="Short stable id of the fault, e.g. 'unloaded-tensor'.")
    severity: Severity = Field(description="INFO: worth knowing; WARNING: works but may be crippled; "
                                           "REFUSAL: would run crippled or fail, so serving stops.")
    title: str = Field(description="One line saying what is wrong.")
    found: str = Field(description="What is in the draft / target, with the names and numbers.")
    expected: str = Field(description="What the engine needs instead.")
    fix: str = Field(description="What to do about it.")
    engine: Engine = Field("all", description="The engine the finding is about ('all' when it holds for any).")

    def applies_to(self, engine: str) -> bool:
        return self.engine == "all" or engine == "all" or self.engine == engine


def worst(findings: list[Finding], engine: str = "all") -> Severity | None:
    relevant = [f.severity for f in findings if f.applies_to(engine)]
    return max(relevant) if relevant else None


def refusal_message(findings: list[Finding], engine: str = "vllm", subject: str = "this EAGLE-3 draft") -> str:
    """The refusals as text: per refusal, what was found and expected, then what to do. Empty when none."""
    refusals = [f for f in findings if f.severity == Severity.REFUSAL and f.applies_to(engine)]
    if not refusals:
        return ""
    lines = [f"kimi-eagle refuses {subject} ({len(refusals)} problem{'s' * (len(refusals) > 1)}; "
             "`kimi-eagle doctor DRAFT --target TARGET` shows the full report):"]
    for f in refusals:
        lines.append(f"- [{f.code}] {f.title}: found {f.found}; expected {f.expected}.")
        lines.append(f"  Fix: {f.fix}")
    return "\n".join(lines)


SHOWN = 6  # names listed per finding before "... and N more"


def listing(items: list[str]) -> str:
    """Names for a finding's text: the first few, then how many more."""
    shown = ", ".join(items[:SHOWN])
    return shown + (f" ... and {len(items) - SHOWN} more" if len(items) > SHOWN else "")


def finding(code: str, severity: Severity, title: str, found: str, expected: str, fix: str,
            engine: Engine = "all") -> Finding:
    return Finding(code=code, severity=severity, title=title, found=found, expected=expected, fix=fix, engine=engine)
