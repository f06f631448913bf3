"""Request parsing rejects each kind of bad field with a 400 naming it; responses have OpenAI's shape."""

from __future__ import annotations

from typing import Any

import pytest

from client.web.errors import APIError, from_exception
from client.web.openai_api import Responder, parse_request
from swarm.errors import CapacityError, NoRouteError, TransportError

MODELS = ("SmolLM2-135M-Instruct", "default")
CHAT: dict[str, Any] = {"model": "default", "messages": [{"role": "user", "content": "hi"}]}


def parse(body: Any, kind: str = "chat") -> Any:
    return parse_request(body, kind, MODELS, default_max_tokens=256, max_tokens_limit=1024)  # type: ignore[arg-type]


def test_defaults_and_fields_are_read() -> None:
    request = parse({**CHAT, "max_tokens": 7, "temperature": 0, "top_p": 0.5, "stop": "\n", "seed": 3})
    assert request.messages == ({"role": "user", "content": "hi"},)
    assert (request.max_tokens, request.temperature, request.top_p, request.stop, request.seed) == (
        7,
        0.0,
        0.5,
        ("\n",),
        3,
    )
    assert not request.stream and not request.include_usage
    assert parse(CHAT).max_tokens == 256 and parse(CHAT).temperature == 1.0
    assert parse({**CHAT, "max_completion_tokens": 9}).max_tokens == 9
    text = parse(
        {"model": "default", "prompt": ["Once"], "stream": True, "stream_options": {"include_usage": True}},
        "text",
    )
    assert text.prompt == "Once" and text.stream and text.include_usage


def test_content_parts_are_joined() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert parse({**CHAT, "messages": [{"role": "user", "content": parts}]}).messages[0]["content"] == "ab"


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"model": None}, "model"),
        ({"model": 3}, "model"),
        ({"model": "gpt-17"}, "model"),
        ({"messages": None}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 1025}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": 3}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 2}, "n"),
        ({"stream": "yes"}, "stream"),
        ({"stream_options": {"include_usage": "y"}}, "stream_options"),
        ({"stop": ["a", ""]}, "stop"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"seed": "x"}, "seed"),
    ],
)
def test_each_bad_field_is_a_400_naming_it(change: dict[str, Any], param: str) -> None:
    body = {**CHAT, **change}
    body = {k: v for k, v in body.items() if v is not None}
    with pytest.raises(APIError) as caught:
        parse(body)
    assert caught.value.status == 400 and caught.value.param == param
    assert set(caught.value.body()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("body", [[1], "text", None, 3])
def test_a_body_that_is_not_an_object_is_a_400(body: Any) -> None:
    with pytest.raises(APIError, match="JSON object"):
        parse(body)


def test_completions_need_one_prompt() -> None:
    for bad in (
        {"model": "default"},
        {"model": "default", "prompt": ""},
        {"model": "default", "prompt": ["a", "b"]},
    ):
        with pytest.raises(APIError) as caught:
            parse(bad, "text")
        assert caught.value.param == "prompt"


def test_responses_have_openai_shapes() -> None:
    chat = Responder.new("chat", "abc", "default")
    first, piece, last = chat.chunk("", first=True), chat.chunk("Pa"), chat.chunk("", "stop")
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert piece["object"] == "chat.completion.chunk" and piece["choices"][0]["delta"] == {"content": "Pa"}
    assert last["choices"][0]["finish_reason"] == "stop" and first["id"] == last["id"] == "chatcmpl-abc"
    assert chat.usage_chunk(3, 4)["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    whole = chat.whole("Paris", "stop", 3, 1)
    assert whole["object"] == "chat.completion" and whole["choices"][0]["message"]["content"] == "Paris"
    text = Responder.new("text", "abc", "default").whole("Paris", "length", 3, 1)
    assert text["object"] == "text_completion" and text["choices"][0]["text"] == "Paris"


def test_swarm_failures_become_plain_503s_and_timeouts_504() -> None:
    assert from_exception(NoRouteError([20, 21])).status == 503
    assert "20:22" in from_exception(NoRouteError([20, 21])).message
    assert from_exception(CapacityError("full")).code == "swarm_busy"
    assert from_exception(TransportError("gone")).code == "peer_failed"
    assert from_exception(TimeoutError()).status == 504
    assert from_exception(KeyError("bug")).status == 503  # never a bare 500 with a traceback
