"""RemoteChain's step with a wait at the last hop: the output is the answer once it is here, and a failure names
the hop that failed. The two calls (the step to the first hop, the wait at the last) are scripted fakes."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

import pytest
import torch

from client import chain as chain_module
from client.chain import RemoteChain
from swarm.codec import ActivationConfig
from swarm.dht.schemas import LinkMeasure
from swarm.errors import SwarmError, TransportError
from swarm.routing.route import Stage
from swarm.types import LayerRange, NodeID, SessionID
from swarm.wire import StepAck, StepReply, StepRequest, StepWait
from tests.unit.dht.records import peer_record

pytestmark = pytest.mark.timeout(30)

STAGES = (Stage(NodeID("QmFirst"), LayerRange(0, 2)), Stage(NodeID("QmLast"), LayerRange(2, 4)))
OUTPUT = torch.full((1, 8), 3.0)
_A = TypeVar("_A")


class Calls:
    """The step's acknowledgement and the wait's output, each let out (or failed) when the test says."""

    def __init__(self) -> None:
        self.ack: asyncio.Future[StepAck] = asyncio.get_running_loop().create_future()
        self.output: asyncio.Future[StepReply] = asyncio.get_running_loop().create_future()
        self.cancelled: set[str] = set()  # "step", "wait": the calls cancelled while they waited
        self.stepping: asyncio.Future[torch.Tensor] | None = None  # RemoteChain.step under test, once started

    @property
    def step_cancelled(self) -> bool:
        return "step" in self.cancelled

    @property
    def wait_cancelled(self) -> bool:
        return "wait" in self.cancelled

    async def step(self, *_: Any, **__: Any) -> StepAck:
        return await self._answer("step", self.ack)

    async def wait(self, *_: Any, **__: Any) -> StepReply:
        return await self._answer("wait", self.output)

    async def _answer(self, call: str, answer: asyncio.Future[_A]) -> _A:
        try:
            return await answer
        except asyncio.CancelledError:
            self.cancelled.add(call)
            raise


Move = Callable[[Calls], object]  # what the test lets happen next: a call answers, fails, or is cancelled


def _run(monkeypatch: pytest.MonkeyPatch, *moves: Move) -> tuple[Calls, torch.Tensor | BaseException]:
    """RemoteChain.step against the fakes, with ``moves`` made one after another, each once the step has
    settled after the one before."""

    async def main() -> tuple[Calls, torch.Tensor | BaseException]:
        calls = Calls()
        monkeypatch.setattr(chain_module, "call_step_acked", calls.step)
        monkeypatch.setattr(chain_module, "call_wait", calls.wait)
        remote = RemoteChain(None, lambda _: (), "hash", torch.float32, 10.0, 10.0)  # type: ignore[arg-type]
        stepping = calls.stepping = asyncio.ensure_future(
            remote.step(SessionID("s"), STAGES, 4, torch.zeros(1, 8), 64)
        )
        for move in moves:
            await _settle()
            move(calls)
        try:
            return calls, await stepping
        except BaseException as e:  # a failure, or the CancelledError of a cancelled step
            return calls, e

    return asyncio.run(main())


def _failure(peer_id: str) -> SwarmError:
    error = TransportError(f"peer {peer_id} is unreachable")
    error.failed_peer_id = peer_id
    return error


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_the_output_is_the_answer_and_the_acknowledgement_is_left_to_come(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first hop still holds the acknowledgement back when the output comes: the step answers with the
    output, and its call is left to end on its stream (cancelled, it would close the stream, and the next step
    would open another); a call still waiting when the chain closes is cancelled then."""

    async def main() -> None:
        calls = Calls()
        monkeypatch.setattr(chain_module, "call_step_acked", calls.step)
        monkeypatch.setattr(chain_module, "call_wait", calls.wait)
        remote = RemoteChain(None, lambda _: (), "hash", torch.float32, 10.0, 10.0)  # type: ignore[arg-type]
        stepping = asyncio.ensure_future(remote.step(SessionID("s"), STAGES, 4, torch.zeros(1, 8), 64))
        await _settle()
        calls.output.set_result(StepReply(OUTPUT))
        assert torch.equal(await stepping, OUTPUT)
        await _settle()
        assert not calls.step_cancelled and len(remote._acknowledging) == 1
        calls.ack.set_result(StepAck())
        await _settle()
        assert not remote._acknowledging  # ended, and forgotten

        later = Calls()  # another step, whose acknowledgement never comes
        monkeypatch.setattr(chain_module, "call_step_acked", later.step)
        monkeypatch.setattr(chain_module, "call_wait", later.wait)
        stepping = asyncio.ensure_future(remote.step(SessionID("s"), STAGES, 5, torch.zeros(1, 8), 64))
        await _settle()
        later.output.set_result(StepReply(OUTPUT))
        await stepping
        await remote.aclose()
        assert later.step_cancelled and not remote._acknowledging

    asyncio.run(main())


def test_the_acknowledgement_first_then_the_output(monkeypatch: pytest.MonkeyPatch) -> None:
    calls, result = _run(
        monkeypatch, lambda c: c.ack.set_result(StepAck()), lambda c: c.output.set_result(StepReply(OUTPUT))
    )
    assert isinstance(result, torch.Tensor) and torch.equal(result, OUTPUT)
    assert not calls.step_cancelled and not calls.wait_cancelled


def test_a_failed_step_names_its_hop_even_when_the_wait_failed_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """The wait at the last hop may fail first (it is dropped there), while the step's own error names the
    middle hop that really failed: that error is the one raised."""
    _, result = _run(
        monkeypatch,
        lambda c: c.output.set_exception(_failure("QmLast")),
        lambda c: c.ack.set_exception(_failure("QmMiddle")),
    )
    assert isinstance(result, SwarmError) and result.failed_peer_id == "QmMiddle"


def test_a_failed_step_cancels_the_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    calls, result = _run(monkeypatch, lambda c: c.ack.set_exception(_failure("QmFirst")))
    assert isinstance(result, SwarmError) and result.failed_peer_id == "QmFirst"
    assert calls.wait_cancelled


def test_a_failed_wait_after_an_accepted_step_is_the_error(monkeypatch: pytest.MonkeyPatch) -> None:
    _, result = _run(
        monkeypatch,
        lambda c: c.ack.set_result(StepAck()),
        lambda c: c.output.set_exception(_failure("QmLast")),
    )
    assert isinstance(result, SwarmError) and result.failed_peer_id == "QmLast"


def test_a_cancelled_step_cancels_both_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    def cancel(calls: Calls) -> None:
        assert calls.stepping is not None
        calls.stepping.cancel()

    calls, result = _run(monkeypatch, cancel)
    assert isinstance(result, asyncio.CancelledError)
    assert calls.step_cancelled and calls.wait_cancelled


@pytest.mark.parametrize("group", [True, False])
def test_a_rounds_steps_and_waits_each_go_as_one_message_unless_told_not_to(
    monkeypatch: pytest.MonkeyPatch, group: bool
) -> None:
    sent: list[tuple[str, str, list[str]]] = []  # (call, peer, session ids)

    async def step_batch(_p2p: object, peer_id: str, requests: list[Any], **_: object) -> list[StepAck]:
        sent.append(("steps", peer_id, [r.session_id for r in requests]))
        return [StepAck() for _ in requests]

    async def wait_batch(_p2p: object, peer_id: str, waits: list[Any], **_: object) -> list[StepReply]:
        sent.append(("waits", peer_id, [w.session_id for w in waits]))
        return [StepReply(torch.full((1, 8), float(w.session_id[1:]))) for w in waits]

    async def step_alone(_p2p: object, peer_id: str, request: Any, **_: object) -> StepAck:
        sent.append(("step", peer_id, [request.session_id]))
        return StepAck()

    async def wait_alone(_p2p: object, peer_id: str, wait: Any, **_: object) -> StepReply:
        sent.append(("wait", peer_id, [wait.session_id]))
        return StepReply(torch.full((1, 8), float(wait.session_id[1:])))

    for name, fake in (
        ("call_step_batch", step_batch),
        ("call_wait_batch", wait_batch),
        ("call_step_acked", step_alone),
        ("call_wait", wait_alone),
    ):
        monkeypatch.setattr(chain_module, name, fake)

    async def main() -> list[torch.Tensor]:
        remote = RemoteChain(None, lambda _: (), "hash", torch.float32, 10.0, 10.0, group)  # type: ignore[arg-type]
        sessions = [SessionID(f"s{i}") for i in (2, 0, 1)]
        return await asyncio.gather(
            *(remote.step(s, STAGES, 4, torch.zeros(1, 8), 64, batch=("round", 3)) for s in sessions)
        )

    outputs = asyncio.run(main())
    assert [float(out[0, 0]) for out in outputs] == [2.0, 0.0, 1.0]  # each session its own output
    if group:
        assert sorted(sent) == [
            ("steps", "QmFirst", ["s2", "s0", "s1"]),
            ("waits", "QmLast", ["s2", "s0", "s1"]),
        ]
    else:
        assert sorted(sent) == sorted(
            [
                (kind, peer, [s])
                for kind, peer in (("step", "QmFirst"), ("wait", "QmLast"))
                for s in ("s2", "s0", "s1")
            ]
        )


def test_a_grouped_step_that_fails_releases_its_wait_at_the_last_hop(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its wait went in one message with the round's others, answered once every wait in it is: the step
    failed before the last hop, so a newer wait for the same step is sent there to fail it at once."""
    released: list[tuple[str, str, float]] = []
    waits_sent = asyncio.Event()

    async def step_batch(_p2p: object, peer_id: str, requests: list[Any], **_: object) -> list[object]:
        await waits_sent.wait()
        return [_failure(peer_id) if r.session_id == "bad" else StepAck() for r in requests]

    async def wait_batch(_p2p: object, peer_id: str, waits: list[Any], **_: object) -> list[StepReply]:
        waits_sent.set()
        await asyncio.Event().wait()  # the peer holds the answer while a wait in it has no output
        return []

    async def wait_alone(_p2p: object, peer_id: str, wait: Any, **_: object) -> StepReply:
        released.append((peer_id, wait.session_id, wait.timeout_s))
        raise _failure(peer_id)

    for name, fake in (
        ("call_step_batch", step_batch),
        ("call_wait_batch", wait_batch),
        ("call_wait", wait_alone),
    ):
        monkeypatch.setattr(chain_module, name, fake)

    async def main() -> tuple[BaseException | torch.Tensor, list[tuple[str, str, float]]]:
        remote = RemoteChain(None, lambda _: (), "hash", torch.float32, 10.0, 10.0)  # type: ignore[arg-type]
        good = asyncio.ensure_future(
            remote.step(SessionID("good"), STAGES, 4, torch.zeros(1, 8), 64, batch=("r", 2))
        )
        try:
            return await remote.step(SessionID("bad"), STAGES, 4, torch.zeros(1, 8), 64, batch=("r", 2)), []
        except SwarmError as error:
            for _ in range(5):
                await asyncio.sleep(0)
            return error, list(released)  # before its mate is cancelled (which releases that one's wait too)
        finally:
            good.cancel()
            await asyncio.gather(good, return_exceptions=True)

    result, first_released = asyncio.run(asyncio.wait_for(main(), 10))
    assert isinstance(result, TransportError) and result.failed_peer_id == "QmFirst"
    assert first_released == [("QmLast", "bad", chain_module.RELEASE_TIMEOUT_S)]


def test_the_client_sends_its_own_hops_in_the_codec_its_setting_and_the_peers_links_choose(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The step to the first hop and the answer back from the last each take the codec of their own link (auto:
    as the peer announced it); a relayed step (a spot-check's route check) goes lossless, exact on every hop."""
    sent: list[StepRequest | StepWait] = []

    async def step(p2p: object, peer_id: str, request: StepRequest, **_: object) -> StepAck | StepReply:
        sent.append(request)
        return StepAck() if request.wait_result else StepReply(OUTPUT)

    async def wait(p2p: object, peer_id: str, request: StepWait, **_: object) -> StepReply:
        sent.append(request)
        return StepReply(OUTPUT, (), request.codec)

    for name in ("call_step_acked", "call_step"):
        monkeypatch.setattr(chain_module, name, step)
    monkeypatch.setattr(chain_module, "call_wait", wait)
    # 8 float32 values a token: 32 bytes, 16 in f16, 17 in q8; 2 layers at 1000 tokens/s each: 2 ms a token
    records = {
        peer_id: peer_record(
            peer_id,
            links={"QmOther": LinkMeasure(rtt_s=0.01, bandwidth_bytes_s=bandwidth)},
            prefill_layer_tokens_s=1000.0,
        )
        for peer_id, bandwidth in (("QmFirst", 1e4), ("QmLast", 1e9))
    }

    async def codecs(mode: str, relayed: bool = False) -> list[str]:
        sent.clear()
        activations = ActivationConfig(mode=mode, auto_fraction=0.25)
        remote = RemoteChain(
            None,  # type: ignore[arg-type]
            lambda _: (),
            "hash",
            torch.float32,
            10.0,
            10.0,
            activations=activations,
            records=records.get,
        )
        await remote.step(SessionID("s"), STAGES, 4, torch.zeros(1, 8), 64, relayed=relayed)
        await remote.aclose()
        assert all(isinstance(m, StepWait) or m.lossless == relayed for m in sent)
        return [m.codec for m in sent]

    async def main() -> None:
        assert await codecs("exact") == ["exact", "exact"]
        assert sorted(await codecs("q8")) == ["q8", "q8"]
        assert await codecs("q8", relayed=True) == ["exact"]
        await codecs("auto")
        chosen = {type(m).__name__: m.codec for m in sent}
        assert chosen == {"StepRequest": "q8", "StepWait": "exact"}, "a slow first link, a fast last one"

    asyncio.run(main())
