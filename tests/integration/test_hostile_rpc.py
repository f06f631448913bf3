"""Hostile callers against a real peer process (tiny model, 127.0.0.1): a msgpack bomb leaves its memory
within a bound and it keeps serving; a client squatting the KV cache is capped while another is still served;
a route naming a hop that is not a peer of the swarm is refused before any compute."""

from __future__ import annotations

import asyncio
import struct
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace

import psutil
import pytest
import torch

from swarm import PROTOCOL_VERSION
from swarm.errors import CapacityError, ProtocolError
from swarm.models.loading import ModelSource, resolve_model
from swarm.testing import LocalSwarm, PeerProcess, swarm_client
from swarm.transport import (
    call_close,
    call_step,
    call_step_acked,
    call_step_batch,
    call_wait,
    call_wait_batch,
)
from swarm.transport.channel import call_raw
from swarm.wire import (
    MAX_FORWARDED_STEPS,
    CloseRequest,
    ErrorReply,
    Hop,
    StepBatch,
    StepBatchReply,
    StepRequest,
    StepWait,
    StepWaits,
    decode_reply,
    encode_request,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

CACHE_TOKENS = 256
BOMB_ARRAYS = 20_000_000  # 20 MB of empty msgpack arrays: ~1.5 GB as Python lists if decoded unbounded
MEMORY_BOUND_BYTES = 200 * 1024**2


@pytest.fixture(scope="module")
def tiny() -> ModelSource:
    torch.set_num_threads(1)
    return resolve_model("tiny")


@pytest.fixture(scope="module")
def peer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PeerProcess]:
    with LocalSwarm(tmp_path_factory.mktemp("hostile_rpc")) as swarm:
        args = ["--no-plan", "--no-follow-plan", "--cache-tokens", str(CACHE_TOKENS)]
        yield swarm.start_peer("0:6", extra_args=args)


def _bomb() -> bytes:
    """[version, "step", <array32 of BOMB_ARRAYS empty arrays>]: tiny to send, huge to decode naively."""
    header = b"\x93" + bytes([PROTOCOL_VERSION]) + b"\xa4step" + b"\xdd" + struct.pack(">I", BOMB_ARRAYS)
    return header + b"\x90" * BOMB_ARRAYS


class PeakRss:
    """Samples a process's resident memory in a thread until stopped; ``peak`` is the largest seen."""

    def __init__(self, pid: int) -> None:
        self.process, self.peak = psutil.Process(pid), 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, self.process.memory_info().rss)

    def __enter__(self) -> PeakRss:
        self.peak = self.process.memory_info().rss
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _step(tiny: ModelSource, session: str, tokens: int, max_length: int) -> StepRequest:
    hidden = torch.randn(tokens, tiny.spec.hidden_size)
    return StepRequest(session, 0, hidden, 0, 6, max_length, tiny.spec.weights_hash)


def test_a_msgpack_bomb_is_refused_within_a_memory_bound_and_the_peer_keeps_serving(
    peer: PeerProcess, tiny: ModelSource
) -> None:
    async def body() -> None:
        async with swarm_client(peer.maddrs, tiny.spec.weights_hash) as (_dht, _directory, p2p):
            before = psutil.Process(peer.proc.pid).memory_info().rss
            with PeakRss(peer.proc.pid) as rss:
                raw = await call_raw(p2p, peer.peer_id, _bomb(), maddrs=peer.maddrs, timeout_s=60)
            reply = decode_reply(raw)
            assert isinstance(reply, ErrorReply) and reply.code == "protocol", reply
            assert rss.peak - before < MEMORY_BOUND_BYTES, (
                f"peak grew by {(rss.peak - before) / 2**20:.0f} MiB"
            )
            ok = await call_step(p2p, peer.peer_id, _step(tiny, uuid.uuid4().hex, 2, 8), timeout_s=30)
            assert ok.hidden.shape == (2, tiny.spec.hidden_size)

    asyncio.run(body())


def test_a_kv_squatting_client_is_capped_while_another_is_served(
    peer: PeerProcess, tiny: ModelSource
) -> None:
    async def body() -> None:
        async with (
            swarm_client(peer.maddrs, tiny.spec.weights_hash) as (_d1, _r1, squatter),
            swarm_client(peer.maddrs, tiny.spec.weights_hash) as (_d2, _r2, other),
        ):
            with pytest.raises(CapacityError):  # longer than the whole cache: never
                await call_step(squatter, peer.peer_id, _step(tiny, "all", 1, 2 * CACHE_TOKENS), timeout_s=30)
            # The cache is taken as tokens come (max_length_tokens reserves nothing): a squatter holds what it
            # sends, up to one caller's share (half the cache), and no more.
            half = CACHE_TOKENS // 2
            await call_step(squatter, peer.peer_id, _step(tiny, "half", half, half), timeout_s=30)
            with pytest.raises(CapacityError):  # its share is used up
                await call_step(squatter, peer.peer_id, _step(tiny, "more", 8, 8), timeout_s=30)
            reply = await call_step(other, peer.peer_id, _step(tiny, "mine", half // 2, half), timeout_s=30)
            assert reply.hidden.shape == (half // 2, tiny.spec.hidden_size)

    asyncio.run(body())


def test_a_route_through_a_hop_that_is_no_peer_of_the_swarm_is_refused(
    peer: PeerProcess, tiny: ModelSource
) -> None:
    """The next hop named is a client's own libp2p node: a real, dialable id, but no record in the DHT. Before,
    the peer computed the step and dialled it; now it refuses at once with CapacityError naming that hop (the
    client routes around it, bans nobody). Its view comes from its DHT reads (every link poll, ~2 s), so a
    request sent before the first read is let through: the test asks until the refusal comes."""

    async def body() -> None:
        async with swarm_client(peer.maddrs, tiny.spec.weights_hash) as (_dht, _directory, p2p):
            ghost = p2p.peer_id.to_base58()
            deadline, answers = time.monotonic() + 120, []
            while time.monotonic() < deadline:
                request = _step(tiny, uuid.uuid4().hex, 2, 2)
                request = StepRequest(
                    request.session_id,
                    0,
                    request.hidden,
                    0,
                    3,
                    2,
                    request.model_hash,
                    route_rest=(Hop(ghost, (), 3, 6),),
                    timeout_s=10.0,
                )
                try:
                    await call_step(p2p, peer.peer_id, request, timeout_s=15)
                    answers.append("served")
                except CapacityError as e:
                    assert "not a live peer" in str(e) and e.failed_peer_id == ghost
                    break
                except Exception as e:  # before the peer's first read: it forwarded, and the ghost failed
                    answers.append(type(e).__name__)
                await asyncio.sleep(0.5)
            else:
                raise AssertionError(f"never refused; answers: {answers}")
            reply = await call_step(p2p, peer.peer_id, _step(tiny, uuid.uuid4().hex, 2, 8), timeout_s=30)
            assert reply.hidden.shape == (2, tiny.spec.hidden_size)  # and it keeps serving

    asyncio.run(body())


def test_a_clients_waits_in_one_message_over_real_p2p_answer_each_and_fail_alone(
    peer: PeerProcess, tiny: ModelSource
) -> None:
    """StepWaits (a client's round waiting for its outputs at the last hop in one message) from a real libp2p
    node: each wait gets the output its step left, equal to the same step answered directly; a wait for a step
    that never came fails in its own outcome at its deadline; a message of more than MAX_FORWARDED_STEPS waits
    is refused whole; the peer serves on."""

    async def body() -> None:
        async with swarm_client(peer.maddrs, tiny.spec.weights_hash) as (_dht, _directory, p2p):
            good = [replace(_step(tiny, uuid.uuid4().hex, 1, 4), wait_result=True) for _ in range(3)]
            for step in good:
                await call_step_acked(p2p, peer.peer_id, step, maddrs=peer.maddrs, timeout_s=30)
            waits = [StepWait(step.session_id, 0, 30.0) for step in good]
            waits.insert(1, StepWait(uuid.uuid4().hex, 0, 0.2))
            outcomes = await call_wait_batch(p2p, peer.peer_id, waits, maddrs=peer.maddrs, timeout_s=30)
            assert [type(o).__name__ for o in outcomes] == [
                "StepReply",
                "CapacityError",
                "StepReply",
                "StepReply",
            ]
            opened = [step.session_id for step in good]
            for step, outcome in zip(good, [outcomes[0], *outcomes[2:]], strict=True):
                opened.append(uuid.uuid4().hex)
                alone = await call_step(
                    p2p, peer.peer_id, replace(step, session_id=opened[-1], wait_result=False), timeout_s=30
                )
                assert torch.allclose(outcome.hidden, alone.hidden, atol=1e-5)  # type: ignore[union-attr]
            for session_id in opened:  # the peer's cache is small: the tests after this one need it
                await call_close(p2p, peer.peer_id, CloseRequest(session_id))
            too_many = StepWaits(
                tuple(StepWait(uuid.uuid4().hex, 0, 1.0) for _ in range(MAX_FORWARDED_STEPS + 1))
            )
            refused = decode_reply(await call_raw(p2p, peer.peer_id, encode_request(too_many), timeout_s=30))
            assert isinstance(refused, ErrorReply) and refused.code == "protocol", refused
            ok = await call_step(p2p, peer.peer_id, _step(tiny, uuid.uuid4().hex, 2, 8), timeout_s=30)
            assert ok.hidden.shape == (2, tiny.spec.hidden_size)

    asyncio.run(body())


def test_forwarded_step_batches_over_real_p2p_answer_each_step_and_refuse_bad_ones_alone(
    peer: PeerProcess, tiny: ModelSource
) -> None:
    """A StepBatch (what a hop sends the next hop of its decode steps' route, swarm.peer.forwarding) from a real
    libp2p node: each good step is acknowledged and its output waits for the client's wait, equal to the same
    step sent alone; a bad step is refused in its own outcome; a batch over MAX_FORWARDED_STEPS is refused
    whole; the peer serves on."""

    async def body() -> None:
        async with swarm_client(peer.maddrs, tiny.spec.weights_hash) as (_dht, _directory, p2p):
            good = [replace(_step(tiny, uuid.uuid4().hex, 1, 4), wait_result=True) for _ in range(3)]
            bad_size = replace(good[0], session_id=uuid.uuid4().hex, hidden=torch.randn(1, 3))
            rest = (Hop(peer.peer_id, (), 3, 6),)  # a resend names hops to send to, or it does not decode
            resend = replace(
                good[0],
                session_id=uuid.uuid4().hex,
                resend_tokens=1,
                hidden=torch.empty(0, tiny.spec.hidden_size),
                end=3,
                route_rest=rest,
            )
            broken = replace(resend, route_rest=())
            raw = await call_raw(
                p2p, peer.peer_id, encode_request(StepBatch((good[0], broken))), timeout_s=30
            )
            # a step that does not decode makes the message malformed: it is refused whole
            refused = decode_reply(raw)
            assert isinstance(refused, ErrorReply) and refused.code == "protocol", refused
            batch = (good[0], bad_size, good[1], resend, good[2])  # raw: our call_step_batch sends no resend
            raw = await call_raw(
                p2p, peer.peer_id, encode_request(StepBatch(batch)), maddrs=peer.maddrs, timeout_s=30
            )
            reply = decode_reply(raw)
            assert isinstance(reply, StepBatchReply), reply
            kinds = [type(o).__name__ for o in reply.outcomes]
            assert kinds == ["StepAck", "ErrorReply", "StepAck", "ErrorReply", "StepAck"]
            errors = [o for o in reply.outcomes if isinstance(o, ErrorReply)]
            assert [e.code for e in errors] == ["protocol", "protocol"] and "resend" in errors[1].message
            for step in good:
                waited = await call_wait(p2p, peer.peer_id, StepWait(step.session_id, 0, 30.0), timeout_s=30)
                alone = await call_step(
                    p2p,
                    peer.peer_id,
                    replace(step, session_id=uuid.uuid4().hex, wait_result=False),
                    timeout_s=30,
                )
                assert torch.allclose(waited.hidden, alone.hidden, atol=1e-5)
            too_many = [replace(good[0], session_id=uuid.uuid4().hex) for _ in range(MAX_FORWARDED_STEPS + 1)]
            with pytest.raises(ProtocolError):
                await call_step_batch(p2p, peer.peer_id, too_many, maddrs=peer.maddrs, timeout_s=30)
            ok = await call_step(p2p, peer.peer_id, _step(tiny, uuid.uuid4().hex, 2, 8), timeout_s=30)
            assert ok.hidden.shape == (2, tiny.spec.hidden_size)

    asyncio.run(body())
