"""One record per request, built from raw timestamps while the response streams in.

Timestamps are `time.perf_counter()` offsets from the moment the request was sent, in milliseconds. Token counts
per chunk come from the server (cumulative `usage.completion_tokens` on each chunk, else one logprob entry per
token); when the server gives neither, they are None and only the final usage is known.
"""

from __future__ import annotations

import json
from itertools import pairwise
from typing import Any

from pydantic import BaseModel, Field

from kimi_eagle.acceptance import SpecRequestFigures, spec_figures_from


class RequestRecord(BaseModel):
    worker: str = Field(description="Locust process that sent it (`local` or the worker's id).")
    index: int = Field(description="Sequence number within that process.")
    prompt_index: int
    api: str
    stream: bool
    start_unix_s: float
    ok: bool
    error: str | None = None
    status_code: int | None = None
    ttft_ms: float | None = Field(None, description="Until the first chunk with non-empty text; None unless streamed.")
    latency_ms: float | None = Field(None, description="Until the last byte of the response.")
    chunk_offsets_ms: list[float] = Field(default_factory=list, description="Arrival of each token-carrying chunk.")
    chunk_tokens: list[int | None] = Field(default_factory=list, description="Tokens in each of those chunks.")
    prompt_tokens: int | None = Field(None, description="Server usage.")
    completion_tokens: int | None = Field(None, description="Server usage.")
    spec: SpecRequestFigures | None = None

    @property
    def counted_tokens(self) -> int | None:
        """Tokens summed over the chunks, or None when a chunk's count is unknown."""
        if not self.chunk_tokens or any(n is None for n in self.chunk_tokens):
            return None
        return sum(n for n in self.chunk_tokens if n is not None)

    @property
    def tpot_ms(self) -> float | None:
        """Time per output token after the first, with the server's token count (what speculative decoding
        changes): (latency - TTFT) / (tokens - 1)."""
        if self.ttft_ms is None or self.latency_ms is None or not self.completion_tokens:
            return None
        if self.completion_tokens < 2:
            return None
        return (self.latency_ms - self.ttft_ms) / (self.completion_tokens - 1)

    def inter_chunk_ms(self) -> list[float]:
        """Gaps between consecutive token-carrying chunks, from the first content chunk on."""
        offsets = self.chunk_offsets_ms
        return [b - a for a, b in pairwise(offsets)]

    def per_token_itl_ms(self) -> list[float]:
        """Token-accurate ITL: each gap split evenly over the tokens of the chunk that ended it, one value per
        token. Empty when per-chunk counts are unknown."""
        counts = self.chunk_tokens[1:]
        if any(n is None for n in counts):
            return []
        out: list[float] = []
        for gap, n in zip(self.inter_chunk_ms(), counts):
            if n:
                out.extend([gap / n] * n)
        return out


def _content_of(choice: dict[str, Any]) -> str:
    if "text" in choice:
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    return (delta.get("content") or "") + (delta.get("reasoning_content") or delta.get("reasoning") or "")


def _logprob_count(choice: dict[str, Any]) -> int | None:
    logprobs = choice.get("logprobs")
    if not logprobs:
        return None
    if isinstance(logprobs.get("tokens"), list):  # completions API
        return len(logprobs["tokens"])
    if isinstance(logprobs.get("content"), list):  # chat API
        return len(logprobs["content"])
    return None


class StreamAccumulator:
    """Feeds on SSE lines as they arrive and keeps what a RequestRecord needs."""

    def __init__(self) -> None:
        self.ttft_ms: float | None = None
        self.chunk_offsets_ms: list[float] = []
        self.chunk_tokens: list[int | None] = []
        self.usage: dict[str, Any] | None = None
        self.spec: SpecRequestFigures | None = None
        self.error: str | None = None
        self.done = False
        self._seen_tokens = 0
        self._pending_tokens: int | None = 0  # tokens that arrived before the first content chunk

    def feed(self, line: bytes, offset_ms: float) -> None:
        text = line.decode("utf-8", errors="replace").strip()
        if not text.startswith("data:"):
            return  # blank separators, comments, `event:` lines
        data = text.removeprefix("data:").strip()
        if data == "[DONE]":
            self.done = True
            return
        try:
            chunk = json.loads(data)
        except json.JSONDecodeError:
            self.error = f"unparseable SSE data: {data[:120]!r}"
            return
        if "error" in chunk and not chunk.get("choices"):
            self.error = str(chunk["error"])[:300]
            return
        self._on_chunk(chunk, offset_ms)

    def _on_chunk(self, chunk: dict[str, Any], offset_ms: float) -> None:
        usage = chunk.get("usage")
        choices = chunk.get("choices") or []
        if "metrics" in chunk or "sglext" in chunk or any("sglext" in c for c in choices):
            self.spec = spec_figures_from(chunk) or self.spec
        if not choices:
            # The final usage chunk: the total, not a chunk of tokens of its own.
            if usage:
                self.usage = usage
            return
        new_tokens: int | None = None
        if usage and usage.get("completion_tokens") is not None:
            new_tokens = usage["completion_tokens"] - self._seen_tokens
            self._seen_tokens = usage["completion_tokens"]
            self.usage = usage
        else:
            new_tokens = _logprob_count(choices[0])
        content = _content_of(choices[0])
        if self.ttft_ms is None:
            # Tokens may arrive with empty text (SGLang's first chunk; held-back partial UTF-8): carry them to
            # the first chunk that shows text, which is where TTFT is taken.
            if self._pending_tokens is not None:
                self._pending_tokens = None if new_tokens is None else self._pending_tokens + new_tokens
            if content:
                self.ttft_ms = offset_ms
                self.chunk_offsets_ms.append(offset_ms)
                self.chunk_tokens.append(self._pending_tokens)
            return
        if new_tokens or (new_tokens is None and content):
            self.chunk_offsets_ms.append(offset_ms)
            self.chunk_tokens.append(new_tokens)
