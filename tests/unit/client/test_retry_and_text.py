"""Pure pieces of the client: retry decisions by error class, stop strings, config validation."""

from __future__ import annotations

import pytest

from client.config import ClientConfig
from client.generation import GenerationRequest, StopMatcher
from client.retry import Action, RetryPolicy
from swarm.errors import (
    CapacityError,
    ModelMismatch,
    NoRouteError,
    ProtocolError,
    SessionError,
    SessionEvicted,
    TransportError,
    VersionMismatch,
)
from swarm.types import NodeID

pytestmark = pytest.mark.timeout(10)


def _named(error: Exception, peer: str) -> Exception:
    error.failed_peer_id = peer  # type: ignore[attr-defined]
    return error


@pytest.mark.parametrize(
    ("error", "action"),
    [
        (TransportError("gone"), Action.BAN_AND_REROUTE),
        (TimeoutError(), Action.BAN_AND_REROUTE),
        (ConnectionResetError(), Action.BAN_AND_REROUTE),
        (ProtocolError("garbage"), Action.BAN_AND_REROUTE),
        (CapacityError("full"), Action.REROUTE),
        (SessionError("unknown session"), Action.REPLAY),
        (SessionEvicted("idle while the cache was short"), Action.REPLAY),
        (VersionMismatch("v2"), Action.GIVE_UP),
        (ModelMismatch("other weights"), Action.GIVE_UP),
        (NoRouteError([3]), Action.GIVE_UP),
        (ValueError("a bug"), Action.GIVE_UP),
    ],
)
def test_each_error_class_has_one_action(error: Exception, action: Action) -> None:
    assert RetryPolicy(max_retries=3, retry_delay_s=0.1).decide(error, 0).action is action


def test_capacity_errors_are_never_a_reason_to_ban() -> None:
    """A peer that is full, leaving or moved says so honestly: route around it, but do not ban it."""
    policy = RetryPolicy(max_retries=3, retry_delay_s=0.0)
    for attempt in range(3):
        assert policy.decide(_named(CapacityError("leaving"), "peer-b"), attempt).action is Action.REROUTE
    assert policy.decide(_named(ProtocolError("bad"), "peer-b"), 0).action is Action.BAN_AND_REROUTE


def test_only_errors_that_cannot_name_the_hop_ask_each_peer() -> None:
    policy = RetryPolicy(max_retries=3, retry_delay_s=0.0)
    asks = {
        type(e).__name__: policy.decide(e, 0, NodeID("peer-a")).find_silent
        for e in (
            TransportError("x"),
            TimeoutError(),
            ProtocolError("x"),
            CapacityError("x"),
            SessionError("x"),
        )
    }
    assert asks == {
        "TransportError": True,
        "TimeoutError": True,
        "ProtocolError": False,
        "CapacityError": False,
        "SessionError": False,
    }


def test_retries_are_bounded_and_back_off() -> None:
    policy = RetryPolicy(max_retries=2, retry_delay_s=0.1)
    error = TransportError("gone")
    assert [policy.decide(error, a).delay_s for a in (0, 1)] == [0.1, 0.2]
    assert policy.decide(error, 2).action is Action.GIVE_UP


def test_blame_goes_to_the_named_peer_else_the_first_hop() -> None:
    policy = RetryPolicy(max_retries=3, retry_delay_s=0.0)
    named = _named(TransportError("hop 2 died"), "peer-b")
    assert policy.decide(named, 0, NodeID("peer-a")).failed_peer == "peer-b"
    assert policy.decide(TimeoutError(), 0, NodeID("peer-a")).failed_peer == "peer-a"


def test_stop_strings_are_held_back_then_cut() -> None:
    stops = StopMatcher(["\nUser:"])
    out = []
    for piece in ["Paris", ".", "\nU", "ser", ": more"]:
        text, stopped = stops.push(piece)
        out.append(text)
        if stopped:
            break
    assert "".join(out) == "Paris."
    assert stopped


def test_a_false_start_of_a_stop_string_is_released() -> None:
    stops = StopMatcher(["STOP"])
    assert stops.push("ST") == ("", False)
    assert stops.push("ay") == ("STay", False)
    assert stops.push("S") == ("", False)
    assert stops.flush() == "S"


def test_bad_requests_and_configs_are_refused_with_clear_errors() -> None:
    with pytest.raises(ValueError, match="prompt is empty"):
        GenerationRequest((), 5, frozenset())
    with pytest.raises(ValueError, match="max_new_tokens"):
        GenerationRequest((1,), -1, frozenset())
    with pytest.raises(ValueError, match="initial_peers"):
        ClientConfig(initial_peers="/ip4/127.0.0.1/tcp/1")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cache_high_water"):
        ClientConfig(cache_high_water=1.5)
    with pytest.raises(ValueError, match="step_timeout_s"):
        ClientConfig(step_timeout_s=0)
