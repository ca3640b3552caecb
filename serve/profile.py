"""Serving profiles (`serve/profiles/*.yaml`): what to serve, and with which vLLM flags."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

PROFILES_DIR = Path(__file__).resolve().parent / "profiles"
DEFAULT_PROFILE = "tiny-cpu"
FIXTURE_PREFIX = "fixture:"


class ProfileError(ValueError):
    """A profile that cannot be used; the message names the file and the fix."""


class Speculative(BaseModel):
    model_config = ConfigDict(extra="forbid")
    method: Literal["eagle3"] = Field("eagle3", description="vLLM's speculative method; EAGLE-3 drafts only.")
    num_speculative_tokens: int = Field(3, ge=1, le=16, description="Draft tokens proposed per step (k).")
    num_speculative_tokens_per_batch_size: list[tuple[int, int, int]] | None = Field(
        None, description="vLLM's dynamic speculation schedule: [[first, last, k], ...] inclusive batch-size ranges, "
                          "the first starting at 1, k <= num_speculative_tokens and 0 where speculation loses; "
                          "measured by `kimi-eagle bench tune`. Passed in --speculative-config; --dry-run "
                          "checks it with vLLM's own code.")
    per_request_metrics: Literal["none", "summary", "detailed"] = Field(
        "none", description="vLLM's --per-request-spec-decode-metrics: each response carries its own acceptance "
                            "(`metrics.speculative_decoding`). Passed only when a draft is served: vLLM refuses "
                            "the flag without speculation.")

    @model_validator(mode="after")
    def _schedule_within_k(self) -> Speculative:
        # vLLM caps a larger k at num_speculative_tokens without a word (build_dynamic_sd_schedule_lookup's min).
        schedule = self.num_speculative_tokens_per_batch_size or []
        too_large = [list(r) for r in schedule if r[2] > self.num_speculative_tokens]
        if too_large:
            raise ValueError(f"num_speculative_tokens_per_batch_size asks for k above num_speculative_tokens "
                             f"{self.num_speculative_tokens} in {too_large}: vLLM would cap it there silently; raise "
                             f"num_speculative_tokens to the schedule's largest k")
        return self


class Profile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    description: str
    needs: str = Field(description="The hardware the profile needs, for humans.")
    target: str = Field(description="Target checkpoint: a folder, a hub name, or `fixture:target`.")
    draft: str | None = Field(None, description="EAGLE-3 draft folder (speculators format), or `fixture:draft`.")
    served_model_name: str
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    trust_remote_code: bool = Field(False, description="Only where the target needs it (the real Kimi-K2.5).")
    speculative: Speculative = Field(default_factory=Speculative)
    vllm_args: dict[str, Any] = Field(default_factory=dict, description="vLLM CLI flags without the leading --.")
    env: dict[str, str] = Field(default_factory=dict, description="Environment for the vLLM processes.")


def available_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILES_DIR.glob("*.yaml"))


def profile_path(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if path.suffix not in (".yaml", ".yml"):  # names have dots too: kimi-k2.5-h200x8
        path = PROFILES_DIR / f"{name_or_path}.yaml"
    return path


def load_profile(name_or_path: str) -> Profile:
    path = profile_path(name_or_path)
    if not path.is_file():
        raise ProfileError(f"no profile {name_or_path!r}: known profiles are {', '.join(available_profiles())} "
                           f"(or give the path of a YAML file)")
    try:
        data = yaml.safe_load(path.read_text())
        return Profile.model_validate(data)
    except (yaml.YAMLError, ValueError) as exc:
        raise ProfileError(f"profile {path} is not valid: {exc}") from None


SCHEDULE_KEY = "num_speculative_tokens_per_batch_size"


def write_schedule(path: Path, schedule: list[tuple[int, int, int]], source: str) -> None:
    """Put a measured schedule (and the k it needs) into the profile's `speculative:` block, keeping the file's
    comments: the line is replaced where it exists, else added under `num_speculative_tokens`."""
    lines = [line for line in path.read_text().splitlines()
             if not line.strip().startswith((f"{SCHEDULE_KEY}:", f"# {SCHEDULE_KEY} "))]
    k_line = next((i for i, line in enumerate(lines) if line.strip().startswith("num_speculative_tokens:")), None)
    if k_line is None:
        raise ProfileError(f"{path}: no `speculative.num_speculative_tokens` line to put the schedule under")
    indent = lines[k_line][: len(lines[k_line]) - len(lines[k_line].lstrip())]
    lines[k_line] = f"{indent}num_speculative_tokens: {max(k for _, _, k in schedule)}"
    lines[k_line + 1:k_line + 1] = [f"{indent}# {SCHEDULE_KEY} measured by `kimi-eagle bench tune` ({source})",
                                    f"{indent}{SCHEDULE_KEY}: {[list(r) for r in schedule]}"]
    path.write_text("\n".join(lines) + "\n")
    load_profile(str(path))  # what was written must load


def resolve_model_path(ref: str) -> str:
    """`fixture:target` / `fixture:draft` -> the shipped tiny pair; `fixture:real-width-target` / `-draft` -> the tiny
    pair lifted to Kimi-K2.5's widths, built on this machine (here only its configs: the weights, about 13 GB, are
    built before an engine starts, `kimi_eagle.fixtures.real_width.build_for`); anything else is used as given."""
    if not ref.startswith(FIXTURE_PREFIX):
        return ref
    from kimi_eagle.fixtures.pair_spec import DRAFT_DIR, TARGET_DIR

    which = ref.removeprefix(FIXTURE_PREFIX)
    if which in ("real-width-target", "real-width-draft"):
        from kimi_eagle.fixtures import real_width

        built = real_width.configs()
        return str(built.target if which == "real-width-target" else built.draft)
    paths = {"target": TARGET_DIR, "draft": DRAFT_DIR}
    if which not in paths:
        raise ProfileError(f"unknown fixture {ref!r}: use fixture:target, fixture:draft, fixture:real-width-target "
                           "or fixture:real-width-draft")
    return str(paths[which])
