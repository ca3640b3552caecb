"""Prompt sets: the ones shipped in `loadtest/prompts/` and user-supplied JSONL files, in a seeded order."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

PROMPTS_DIR = Path(__file__).resolve().parent / "prompts"
Api = Literal["completions", "chat"]


class PromptError(ValueError):
    """A prompt set that cannot be used; the message names the file, the line and the fix."""


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: str


class PromptLine(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompt: str | None = Field(None, description="Text for the completions API (or one user message for chat).")
    messages: list[ChatMessage] | None = Field(None, description="OpenAI chat messages, for the chat API only.")
    source: str | None = Field(None, description="Where the text came from (not sent).")

    @model_validator(mode="after")
    def _exactly_one(self) -> PromptLine:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of `prompt` (a string) or `messages` (a list of chat messages)")
        if self.prompt is not None and not self.prompt.strip():
            raise ValueError("`prompt` is empty")
        return self

    def request_fields(self, api: Api) -> dict[str, Any]:
        """The part of the request body that carries the prompt."""
        if api == "completions":
            if self.prompt is None:
                raise PromptError("a `messages` line cannot be sent to the completions API: use --api chat, "
                                  "or give `prompt` lines")
            return {"prompt": self.prompt}
        if self.messages is not None:
            return {"messages": [m.model_dump() for m in self.messages]}
        return {"messages": [{"role": "user", "content": self.prompt}]}


def shipped_sets() -> list[str]:
    return sorted(p.stem for p in PROMPTS_DIR.glob("*.jsonl"))


def resolve(name_or_path: str) -> Path:
    """A shipped set's name (`chat-short`) or the path of a JSONL file."""
    shipped = PROMPTS_DIR / f"{name_or_path}.jsonl"
    if shipped.is_file():
        return shipped
    path = Path(name_or_path)
    if path.is_file():
        return path
    raise PromptError(f"no prompt set {name_or_path!r}: shipped sets are {', '.join(shipped_sets())}, "
                      f"or give the path of a JSONL file (one {{\"prompt\": ...}} or {{\"messages\": [...]}} a line)")


def load_prompts(name_or_path: str, api: Api, seed: int) -> list[PromptLine]:
    """Every line of the set, checked against `api`, shuffled by `seed` (the same seed, the same order)."""
    path = resolve(name_or_path)
    lines: list[PromptLine] = []
    for number, text in enumerate(path.read_text().splitlines(), start=1):
        if not text.strip():
            continue
        try:
            line = PromptLine.model_validate(json.loads(text))
            line.request_fields(api)
        except json.JSONDecodeError as exc:
            raise PromptError(f"{path}:{number}: not JSON ({exc.msg})") from None
        except ValidationError as exc:
            problems = "; ".join(e["msg"] for e in exc.errors())
            raise PromptError(f"{path}:{number}: {problems}") from None
        except PromptError as exc:
            raise PromptError(f"{path}:{number}: {exc}") from None
        lines.append(line)
    if not lines:
        raise PromptError(f"{path} holds no prompts")
    random.Random(seed).shuffle(lines)
    return lines
