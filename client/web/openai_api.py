"""The OpenAI API's request and response shapes: strict parsing at the boundary, plain dicts going out.

Parsing never trusts the body: every field is checked for presence, type and range, and the first problem
becomes a 400 naming the field (`param`), so a tool speaking the API learns exactly what to fix. Fields the
swarm does not implement but that do not change the answer (user, logprobs=false, presence/frequency penalty
of 0, ...) are accepted and ignored, as OpenAI-compatible servers commonly do.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from client.web.errors import invalid

Kind = Literal["chat", "text"]
ROLES = ("system", "user", "assistant")
MAX_STOP_STRINGS = 4


@dataclass(frozen=True)
class CompletionRequest:
    """One validated request of /v1/chat/completions (kind "chat") or /v1/completions (kind "text")."""

    kind: Kind
    model: str
    messages: tuple[dict[str, str], ...] | None
    prompt: str | None
    max_tokens: int
    temperature: float
    top_p: float
    stop: tuple[str, ...]
    seed: int | None
    stream: bool
    include_usage: bool


def _number(body: Mapping[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise invalid(f"'{name}' must be a number, got {type(value).__name__}", name)
    if not low <= value <= high:
        raise invalid(f"'{name}' must be between {low} and {high}, got {value}", name)
    return float(value)


def _integer(body: Mapping[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(f"'{name}' must be an integer, got {type(value).__name__}", name)
    return value


def _content_text(content: Any, index: int) -> str:
    """A message's content: a string, or a list of {"type": "text", "text": ...} parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise invalid(f"messages[{index}].content parts must be text parts", "messages")
            parts.append(part["text"])
        return "".join(parts)
    raise invalid(f"messages[{index}].content must be a string, got {type(content).__name__}", "messages")


def _messages(body: Mapping[str, Any]) -> tuple[dict[str, str], ...]:
    messages = body.get("messages")
    if messages is None:
        raise invalid("'messages' is a required property", "messages", "missing_required_parameter")
    if not isinstance(messages, list) or not messages:
        raise invalid("'messages' must be a non-empty array", "messages")
    parsed = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise invalid(f"messages[{i}] must be an object, got {type(message).__name__}", "messages")
        role = message.get("role")
        if role not in ROLES:
            raise invalid(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}", "messages")
        parsed.append({"role": role, "content": _content_text(message.get("content"), i)})
    return tuple(parsed)


def _prompt(body: Mapping[str, Any]) -> str:
    prompt = body.get("prompt")
    if prompt is None:
        raise invalid("'prompt' is a required property", "prompt", "missing_required_parameter")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]  # a batch of one prompt
    if not isinstance(prompt, str):
        raise invalid("'prompt' must be a string (one prompt: n=1, no batches)", "prompt")
    if not prompt:
        raise invalid("'prompt' must not be empty", "prompt")
    return prompt


def _stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise invalid("'stop' must be a non-empty string or an array of non-empty strings", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise invalid(f"'stop' takes at most {MAX_STOP_STRINGS} strings", "stop")
    return tuple(stops)


def _max_tokens(body: Mapping[str, Any], kind: Kind, default: int, limit: int) -> int:
    name = (
        "max_completion_tokens"
        if kind == "chat" and body.get("max_completion_tokens") is not None
        else "max_tokens"
    )
    value = _integer(body, name)
    if value is None:
        return default
    if value < 1:
        raise invalid(f"'{name}' must be at least 1, got {value}", name)
    if value > limit:
        raise invalid(f"'{name}' is {value}, but this server allows at most {limit}", name)
    return value


def parse_request(
    body: Any, kind: Kind, models: Collection[str], default_max_tokens: int, max_tokens_limit: int
) -> CompletionRequest:
    """A CompletionRequest from a decoded JSON body, or an APIError (400) naming the first bad field."""
    if not isinstance(body, dict):
        raise invalid(f"the request body must be a JSON object, got {type(body).__name__}")
    model = body.get("model")
    if model is None:
        raise invalid("'model' is a required property", "model", "missing_required_parameter")
    if not isinstance(model, str):
        raise invalid(f"'model' must be a string, got {type(model).__name__}", "model")
    if model not in models:
        raise invalid(
            f"the model '{model}' does not exist here; this server serves {', '.join(sorted(models))}",
            "model",
            "model_not_found",
        )
    n = _integer(body, "n")
    if n is not None and n != 1:
        raise invalid("only n=1 is supported", "n")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise invalid(f"'stream' must be a boolean, got {type(stream).__name__}", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise invalid("'stream_options' must be an object like {\"include_usage\": true}", "stream_options")
    seed = _integer(body, "seed")
    return CompletionRequest(
        kind=kind,
        model=model,
        messages=_messages(body) if kind == "chat" else None,
        prompt=_prompt(body) if kind == "text" else None,
        max_tokens=_max_tokens(body, kind, default_max_tokens, max_tokens_limit),
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0),
        stop=_stop(body),
        seed=None if seed is None else seed % (1 << 63),
        stream=stream,
        include_usage=bool(options.get("include_usage", False)),
    )


# --- responses ----------------------------------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _choice(
    kind: Kind, text: str, finish_reason: str | None, delta: bool, first: bool = False
) -> dict[str, Any]:
    if kind == "text":
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    if delta:
        body = {"role": "assistant", "content": text} if first else {"content": text}
        return {"index": 0, "delta": body, "logprobs": None, "finish_reason": finish_reason}
    message = {"role": "assistant", "content": text}
    return {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}


def _object(kind: Kind, chunk: bool) -> str:
    if kind == "text":
        return "text_completion"
    return "chat.completion.chunk" if chunk else "chat.completion"


@dataclass(frozen=True)
class Responder:
    """Builds the response documents of one request (same id, creation time and model in every chunk)."""

    kind: Kind
    id: str
    model: str
    created: int

    @classmethod
    def new(cls, kind: Kind, request_id: str, model: str) -> Responder:
        prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
        return cls(kind, prefix + request_id, model, int(time.time()))

    def _base(self, chunk: bool) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": _object(self.kind, chunk),
            "created": self.created,
            "model": self.model,
        }

    def chunk(self, text: str, finish_reason: str | None = None, first: bool = False) -> dict[str, Any]:
        return {**self._base(True), "choices": [_choice(self.kind, text, finish_reason, True, first)]}

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        return {**self._base(True), "choices": [], "usage": usage(prompt_tokens, completion_tokens)}

    def whole(
        self, text: str, finish_reason: str, prompt_tokens: int, completion_tokens: int
    ) -> dict[str, Any]:
        return {
            **self._base(False),
            "choices": [_choice(self.kind, text, finish_reason, False)],
            "usage": usage(prompt_tokens, completion_tokens),
        }


def models_list(names: Collection[str]) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [{"id": name, "object": "model", "created": 0, "owned_by": "flowswarm"} for name in names],
    }
