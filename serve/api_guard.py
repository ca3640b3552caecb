"""ASGI middleware for vLLM's OpenAI server (loaded inside the API server process with `--middleware`):

- `RequireApiKey`: vLLM 0.32 checks `--api-key` / `VLLM_API_KEY` only on paths under /v1, /v2, /inference and
  /cohere (`vllm/entrypoints/serve/middleware/authenticate.py`, GUARDED_PREFIX). Other routes it serves by default
  run the model or change the server without a key: POST /invocations (SageMaker: a full completion),
  /tokenize, /detokenize, /abort_requests, /scale_elastic_ep, /start_profile ... This middleware requires the key on
  every path except read-only probes (GET /health, /ping, /metrics, /version, /load), so that "binding beyond
  localhost needs a key" means what it says.
- `RejectBadFields`: vLLM accepts and silently ignores request fields it does not know (a misspelt `max_token`, an
  OpenAI field it does not implement): the client believes a setting applied that did not. This answers 400 naming
  the field instead, as OpenAI's own API does. It also checks `n` against VLLM_MAX_N_SEQUENCES first: vLLM 0.32
  runs its queue admission (`_preflight` -> `check_admission`, 503 "try again later") before it validates `n`
  (`to_sampling_params`), so with `--max-num-queued-reqs` an `n` the server never allows is told to retry forever.
  And a chat message whose `role` the chat API does not define (vLLM renders it into the prompt as text), and
  `allowed_token_ids` together with a structured output, which vLLM answers with a 500 whenever they disagree, and
  a streamed completion with echo, logprobs and n > 1, which it fails now and then.

Both read the environment only (vLLM instantiates middleware classes without arguments) and depend on nothing but
Starlette's ASGI types, so they cost nothing when not in use.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

API_KEY_ENV = "VLLM_API_KEY"
MAX_N_ENV = "VLLM_MAX_N_SEQUENCES"
VLLM_DEFAULT_MAX_N = 16384
OPEN_PATHS = frozenset({"/health", "/ping", "/metrics", "/version", "/load"})
# The roles of OpenAI's chat message types (`ChatCompletionMessageParam`).
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


async def _send_error(send: Send, status: int, message: str, error_type: str, param: str | None = None) -> None:
    """The error body vLLM itself sends (ErrorResponse), so clients parse ours the same way."""
    body = json.dumps({"error": {"message": message, "type": error_type, "param": param, "code": status}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class RequireApiKey:
    """Every request but the read-only probes needs `Authorization: Bearer <VLLM_API_KEY>` (when a key is set)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        key = os.environ.get(API_KEY_ENV) or ""
        self.key_digest = hashlib.sha256(key.encode()).digest() if key else None

    def _authorised(self, scope: Scope) -> bool:
        headers = dict(scope.get("headers") or [])
        scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        if scheme.lower() != "bearer":
            return False
        return secrets.compare_digest(hashlib.sha256(token.encode()).digest(), self.key_digest)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.key_digest is None or scope["type"] not in ("http", "websocket") or scope.get("method") == "OPTIONS":
            return await self.app(scope, receive, send)
        path = scope["path"].removeprefix(scope.get("root_path", "")) or "/"
        if (path in OPEN_PATHS and scope.get("method") in ("GET", "HEAD")) or self._authorised(scope):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1008})
        await _send_error(send, 401, f"{path} needs an API key: send the header 'Authorization: Bearer <key>' "
                                     f"(the key the server was started with, --api-key or {API_KEY_ENV})",
                          "AuthenticationError")


def _known_fields() -> dict[str, frozenset[str]]:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    def names(model: Any) -> frozenset[str]:
        fields = model.model_fields
        return frozenset(fields) | {f.alias for f in fields.values() if f.alias}

    return {"/v1/completions": names(CompletionRequest), "/v1/chat/completions": names(ChatCompletionRequest)}


def _unknown_role(data: object) -> str | None:
    """The first message role that the chat API does not define. vLLM 0.32 takes any string (its message union ends in
    a custom message type with `role: str`) and the chat template renders it as text; OpenAI answers 400."""
    messages = data.get("messages") if isinstance(data, dict) else None
    for message in messages if isinstance(messages, list) else []:
        role = message.get("role") if isinstance(message, dict) else None
        if isinstance(role, str) and role not in CHAT_ROLES:
            return role
    return None


def _grammar_and_allowed_tokens(data: object) -> str | None:
    """The structured-output field of a request that also sends `allowed_token_ids`. Both restrict the tokens; when
    the grammar needs a token the list leaves out, vLLM 0.32 masks every logit, samples token 0, the grammar rejects
    it ("grammar rejected tokens [0] ... Terminating request") and the client gets a 500, with a draft or without."""
    if not isinstance(data, dict) or not data.get("allowed_token_ids"):
        return None
    response_format = data.get("response_format")
    if data.get("structured_outputs"):
        return "structured_outputs"
    if isinstance(response_format, dict) and response_format.get("type") not in (None, "text"):
        return "response_format"
    tool_choice = data.get("tool_choice")
    if tool_choice == "required" or isinstance(tool_choice, dict):  # vLLM turns these into a JSON grammar
        return "tool_choice"
    return None


def _requested_choices(data: object) -> int | None:
    """The request's `n` when it is an integer (JSON `true` is not), else None: vLLM's own validation answers it."""
    n = data.get("n") if isinstance(data, dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) else None


def _streamed_echo_of_several_choices(data: object) -> bool:
    """A streamed completion with `echo`, `logprobs` and n > 1. vLLM 0.32 puts the prompt's logprobs in the first
    streamed output only (`completion/serving.py`, "Prompt details are excluded from later streamed outputs"); a
    choice whose first tokens come in a later output echoes the prompt's token ids with no logprobs for them, and the
    lookup of a prompt token among a generated token's logprobs fails: a 500 (KeyError) inside the stream, measured
    on the default profile 11 of 40 times, 6 of 40 with --no-draft."""
    if not isinstance(data, dict) or not (data.get("stream") and data.get("echo")) or data.get("logprobs") is None:
        return False
    return (_requested_choices(data) or 1) > 1


class RejectBadFields:
    """400 for a completion or chat request with a top-level field the server does not implement, a chat role the API
    does not define, `allowed_token_ids` with a structured output, a streamed completion with echo, logprobs and n > 1,
    or an `n` above the server's limit."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.known = _known_fields()
        self.max_n = int(os.environ.get(MAX_N_ENV) or VLLM_DEFAULT_MAX_N)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "").removeprefix(scope.get("root_path", ""))
        if scope["type"] != "http" or scope.get("method") != "POST" or path not in self.known:
            return await self.app(scope, receive, send)
        chunks, message = [], await receive()
        while message["type"] == "http.request":
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
            message = await receive()
        if message["type"] == "http.disconnect":
            return None
        body = b"".join(chunks)
        try:
            data = json.loads(body)
        except (ValueError, RecursionError):
            data = None  # malformed JSON, bad UTF-8, absurd nesting: vLLM's own parser answers with its 400
        unknown = sorted(set(data) - self.known[path]) if isinstance(data, dict) else []
        if unknown:
            them = "them" if len(unknown) > 1 else "it"
            return await _send_error(
                send, 400, f"unsupported parameter{'s' * (len(unknown) > 1)} for {path}: {', '.join(unknown)} "
                           f"(this server does not implement {them}; remove {them} or check the spelling)",
                "BadRequestError", param=unknown[0])
        role = _unknown_role(data) if path == "/v1/chat/completions" else None
        if role is not None:
            return await _send_error(
                send, 400, f"messages: unknown role {role!r}: a chat message's role is one of "
                           f"{', '.join(CHAT_ROLES)} (check the spelling)", "BadRequestError", param="messages")
        grammar = _grammar_and_allowed_tokens(data)
        if grammar is not None:
            return await _send_error(
                send, 400, f"allowed_token_ids with {grammar}: both restrict the tokens, and vLLM fails the request "
                           "(500) as soon as the structured output needs a token the list leaves out; send one of the "
                           "two (the structured output alone, or allowed_token_ids alone)", "BadRequestError",
                param="allowed_token_ids")
        if path == "/v1/completions" and _streamed_echo_of_several_choices(data):
            return await _send_error(
                send, 400, "echo with logprobs, streamed, with n > 1: vLLM 0.32 fails such a request (500) whenever "
                           "one choice's first tokens come after another's; send n 1, or stream false, or leave out "
                           "echo or logprobs", "BadRequestError", param="echo")
        n = _requested_choices(data)
        if n is not None and n > self.max_n:
            text = f"n must be at most {self.max_n}, got {n} (the server's {MAX_N_ENV}): ask for fewer"
            return await _send_error(send, 400, text, "BadRequestError", param="n")
        replayed = False

        async def replay() -> Message:
            # The body once, then the real channel: vLLM listens on it for the client's disconnect.
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)
