"""Three real ``swarm-peer`` processes (tiny model) on 127.0.0.1: announcements, forwarding, bad input, crashes."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import time
import uuid
from collections.abc import Iterator

import msgpack
import pytest
import torch

from swarm import PROTOCOL_VERSION
from swarm.dht import Directory
from swarm.errors import CapacityError, ModelMismatch, ProtocolError, SessionError, SwarmError
from swarm.models.loading import ModelSource, resolve_model
from swarm.testing import SWARM_PEER, LocalSwarm, PeerProcess, swarm_client
from swarm.transport import call_close, call_info, call_probe, call_step, call_step_acked, call_wait
from swarm.transport.channel import call_raw
from swarm.wire import ErrorReply, Hop, ProbeRequest, StepRequest, StepWait, decode_reply, encode_tensor

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

RANGES = ("0:2", "2:4", "4:6")
FIXED = ["--no-follow-plan"]
TTL_S = 5.0  # a doomed peer's --record-ttl-s
WAIT_S = 120.0  # longest wait for something that must happen: a busy machine is slow, not wrong


@pytest.fixture(scope="module")
def tiny() -> ModelSource:
    torch.set_num_threads(1)
    return resolve_model("tiny")


BIG_REPLY = str(4 * 1024**2)


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSwarm]:
    with LocalSwarm(tmp_path_factory.mktemp("swarm"), model="tiny") as local:
        # Fixed ranges: these tests check forwarding over known hops, not plan following. Peer a sends probe
        # replies past hivemind's 4 MiB unary cap (the malformed-requests test).
        local.start_peer(
            RANGES[0], name="a", extra_args=[*FIXED, "--session-max-probe-reply-bytes", BIG_REPLY]
        )
        local.start_peer(RANGES[1], name="b", extra_args=FIXED, wait=False)
        local.start_peer(RANGES[2], name="c", extra_args=FIXED, wait=False)
        local.wait_all_ready(timeout_s=120)
        yield local


def _hops(peers: list[PeerProcess]) -> list[Hop]:
    hops = []
    for peer, text in zip(peers, RANGES, strict=True):
        start, end = (int(x) for x in text.split(":"))
        hops.append(Hop(peer.peer_id, tuple(peer.maddrs), start, end))
    return hops


def test_peers_see_each_other_with_measured_speed_and_links(swarm: LocalSwarm, tiny: ModelSource) -> None:
    ids = {p.peer_id for p in swarm.peers}

    async def check() -> dict[str, object]:
        async with swarm_client(swarm.initial_peers, tiny.spec.weights_hash) as (_dht, directory, _p2p):
            deadline = time.monotonic() + WAIT_S
            while True:
                peers = (await directory.snapshot()).serving()
                complete = set(peers) == ids and all(
                    r.decode_layer_tokens_s_b1 > 0
                    and r.decode_layer_tokens_s_b8 > 0
                    and r.prefill_layer_tokens_s > 0
                    and set(r.links) == ids - {pid}
                    for pid, r in peers.items()
                )
                if complete or time.monotonic() > deadline:
                    return dict(peers)
                await asyncio.sleep(0.5)

    peers = asyncio.run(check())
    assert set(peers) == ids
    for pid, record in peers.items():
        assert record.decode_layer_tokens_s_b1 > 0 and record.prefill_layer_tokens_s > 0, record
        assert set(record.links) == ids - {pid}, f"{pid} links: {record.links}"
        for link in record.links.values():
            assert 0 < link.rtt_s < 10.0 and link.bandwidth_bytes_s > 0  # measured, and over loopback
            assert (
                link.reverse_bandwidth_bytes_s is not None and link.reverse_bandwidth_bytes_s > 0
            )  # both ways
        assert [record.range_start, record.range_end] in ([0, 2], [2, 4], [4, 6])
        assert record.free_cache_tokens > 0 and record.max_layers >= 1


def test_each_peer_freezes_what_it_loaded_out_of_full_garbage_collections(swarm: LocalSwarm) -> None:
    # torch, transformers and hivemind alone make ~400,000 objects a full collection would walk (swarm.models.heap)
    for peer in swarm.peers:
        found = re.search(r"froze (\d+) loaded objects", peer.log_path.read_text())
        assert found is not None, peer.log_tail()
        assert int(found.group(1)) > 100_000, found.group(0)


def test_three_hop_session_matches_local_model(swarm: LocalSwarm, tiny: ModelSource) -> None:
    head = tiny.load_head()
    local = tiny.load_blocks(0, 6)
    reference = tiny.load_reference_model()
    tokens = torch.randint(0, tiny.spec.vocab_size, (7,), generator=torch.Generator().manual_seed(0))
    first, *rest = _hops(swarm.peers)
    session = uuid.uuid4().hex

    async def run() -> None:
        async with swarm_client(swarm.initial_peers, tiny.spec.weights_hash) as (_dht, _directory, p2p):
            local.open_session(session, 32)
            ids, position, step_input = tokens, 0, head.embed(tokens)
            for step in range(4):  # a prefill of 7 tokens, then 3 greedy decode steps
                request = StepRequest(
                    session,
                    position,
                    step_input,
                    first.start,
                    first.end,
                    32,
                    tiny.spec.weights_hash,
                    tuple(rest),
                )
                reply = await call_step(p2p, first.peer_id, request, maddrs=first.maddrs, timeout_s=30)
                expected = local.forward([local_step(session, step_input, position)])[0]
                assert torch.equal(reply.hidden, expected), f"step {step} differs from the local blocks"
                assert [t.peer_id for t in reply.timings] == [first.peer_id, *[h.peer_id for h in rest]]
                with torch.inference_mode():
                    ref_logits = reference(input_ids=ids[None]).logits[0, -1]
                torch.testing.assert_close(head.logits(reply.hidden)[-1], ref_logits, atol=1e-4, rtol=1e-4)
                position += step_input.shape[0]
                next_id = head.logits(reply.hidden)[-1].argmax()[None]
                ids = torch.cat([ids, next_id])
                step_input = head.embed(next_id)
            assert await call_close(p2p, first.peer_id, _close(session, rest), maddrs=first.maddrs)
            stale = StepRequest(session, position, step_input, 0, 2, 32, tiny.spec.weights_hash, tuple(rest))
            with pytest.raises(SessionError) as error:
                await call_step(p2p, first.peer_id, stale, maddrs=first.maddrs, timeout_s=30)
            assert error.value.failed_peer_id == first.peer_id
            for hop in (first, *rest):
                info = await call_info(p2p, hop.peer_id, maddrs=hop.maddrs)
                assert info.active_sessions == 0 and info.free_cache_tokens == info.cache_tokens_total

    asyncio.run(run())


def test_the_last_hop_answers_the_waiting_client_exactly(swarm: LocalSwarm, tiny: ModelSource) -> None:
    """wait_result: the step's call returns acks of every hop; the output comes from the last hop's wait."""
    head = tiny.load_head()
    local = tiny.load_blocks(0, 6)
    tokens = torch.randint(0, tiny.spec.vocab_size, (5,), generator=torch.Generator().manual_seed(1))
    hops = _hops(swarm.peers)
    first, *rest = hops
    last = hops[-1]
    session = uuid.uuid4().hex

    async def step(p2p, position: int, hidden: torch.Tensor, wait_first: bool) -> torch.Tensor:  # type: ignore[no-untyped-def]
        request = StepRequest(
            session,
            position,
            hidden,
            first.start,
            first.end,
            32,
            tiny.spec.weights_hash,
            tuple(rest),
            30.0,
            True,
        )
        wait = call_wait(
            p2p, last.peer_id, StepWait(session, position, 30.0), maddrs=last.maddrs, timeout_s=30
        )
        acked = call_step_acked(p2p, first.peer_id, request, maddrs=first.maddrs, timeout_s=30)
        if wait_first:  # the wait usually reaches the last hop first; the other order must work as well
            reply, ack = await asyncio.gather(wait, acked)
        else:
            ack = await acked
            reply = await wait
        assert [t.peer_id for t in ack.timings] == [h.peer_id for h in hops]
        assert [t.peer_id for t in reply.timings] == [last.peer_id]
        return reply.hidden

    async def run() -> None:
        async with swarm_client(swarm.initial_peers, tiny.spec.weights_hash) as (_dht, _directory, p2p):
            local.open_session(session, 32)
            position, step_input = 0, head.embed(tokens)
            for i in range(4):  # a prefill of 5 tokens, then 3 greedy decode steps
                out = await step(p2p, position, step_input, wait_first=i % 2 == 0)
                assert torch.equal(out, local.forward([local_step(session, step_input, position)])[0])
                position += step_input.shape[0]
                step_input = head.embed(head.logits(out)[-1].argmax()[None])
            assert await call_close(p2p, first.peer_id, _close(session, rest), maddrs=first.maddrs)
            with pytest.raises(CapacityError, match="deadline"):  # a wait for a step that never comes
                await call_wait(
                    p2p, last.peer_id, StepWait(session, 99, 0.5), maddrs=last.maddrs, timeout_s=10
                )

    asyncio.run(run())


def test_a_wait_result_step_to_an_unreachable_last_hop_names_it(swarm: LocalSwarm, tiny: ModelSource) -> None:
    first, middle, _ = _hops(swarm.peers)
    nobody = "QmNLei78zWmzUdbeRB3CiUfAizWUrbeeZh5K1rhAQKCh51"  # a well-formed id no process has
    route = (middle, Hop(nobody, ("/ip4/127.0.0.1/tcp/9/p2p/" + nobody,), 4, 6))
    hidden = torch.randn(2, tiny.spec.hidden_size)
    session = uuid.uuid4().hex
    request = StepRequest(session, 0, hidden, 0, 2, 8, tiny.spec.weights_hash, route, 10.0, True)

    async def run() -> None:
        async with swarm_client(swarm.initial_peers, tiny.spec.weights_hash) as (_dht, _directory, p2p):
            with pytest.raises(SwarmError) as error:
                await call_step_acked(p2p, first.peer_id, request, maddrs=first.maddrs, timeout_s=20)
            assert error.value.failed_peer_id == nobody
            # a hop with no DHT record is refused before any compute (Peer.check_live), or, when the peer has no
            # complete DHT read yet, the first two hops opened the session: close it either way, so the next tests
            # see idle peers
            await call_close(p2p, first.peer_id, _close(session, [middle]), maddrs=first.maddrs)

    asyncio.run(run())


def local_step(session: str, hidden: torch.Tensor, position: int):  # type: ignore[no-untyped-def]
    from swarm.models.blocks import Step

    return Step(session, hidden, 0, 6, position)


def _close(session: str, rest: list[Hop]):  # type: ignore[no-untyped-def]
    from swarm.wire import CloseRequest

    return CloseRequest(session, tuple(rest))


def _raw_step(**overrides: object) -> bytes:
    body: dict[str, object] = {
        "session_id": "s",
        "position": 0,
        "hidden": encode_tensor(torch.zeros(1, 64)),
        "start": 0,
        "end": 2,
        "max_length_tokens": 16,
        "model_hash": "x",
        "route_rest": [],
    }
    body.update(overrides)
    return msgpack.packb([PROTOCOL_VERSION, "step", body], use_bin_type=True)


def test_malformed_requests_get_clear_errors_and_the_peer_keeps_serving(
    swarm: LocalSwarm, tiny: ModelSource
) -> None:
    peer = swarm.peers[0]
    model_hash = tiny.spec.weights_hash
    h = tiny.spec.hidden_size
    bad: dict[str, tuple[bytes, str, str]] = {
        "garbage": (b"\x00\xffnot msgpack at all", "protocol", "msgpack"),
        "wrong version": (msgpack.packb([PROTOCOL_VERSION + 9, "info", {}]), "version_mismatch", "version"),
        "wrong dtype": (
            _raw_step(
                hidden={"dtype": "int64", "shape": [1, h], "data": b"\0" * 8 * h}, model_hash=model_hash
            ),
            "protocol",
            "dtype",
        ),
        "wrong shape": (
            _raw_step(hidden=encode_tensor(torch.zeros(1, h + 3)), model_hash=model_hash),
            "protocol",
            "hidden size",
        ),
        "bytes short of shape": (
            _raw_step(
                hidden={"dtype": "float32", "shape": [4, h], "data": b"\0" * 12}, model_hash=model_hash
            ),
            "protocol",
            "needs",
        ),
        "oversize tensor": (
            _raw_step(
                hidden={"dtype": "float32", "shape": [60000, 60000], "data": b""}, model_hash=model_hash
            ),
            "protocol",
            "limit",
        ),
        "negative length": (_raw_step(max_length_tokens=-3, model_hash=model_hash), "protocol", "max_length"),
        "negative position": (_raw_step(position=-1, model_hash=model_hash), "protocol", "position"),
        "unknown session": (
            _raw_step(position=5, hidden=encode_tensor(torch.zeros(1, h)), model_hash=model_hash),
            "session",
            "unknown session",
        ),
        "layers not held": (
            _raw_step(start=3, end=5, hidden=encode_tensor(torch.zeros(1, h)), model_hash=model_hash),
            "capacity",
            "holds 0:2",
        ),
        "wrong model": (
            _raw_step(hidden=encode_tensor(torch.zeros(1, h)), model_hash="other"),
            "model_mismatch",
            "",
        ),
    }

    async def run() -> None:
        async with swarm_client(swarm.initial_peers, model_hash) as (_dht, _directory, p2p):
            for what, (data, code, text) in bad.items():
                reply = decode_reply(
                    await call_raw(p2p, peer.peer_id, data, maddrs=peer.maddrs, timeout_s=10)
                )
                assert isinstance(reply, ErrorReply), what
                assert reply.code == code, f"{what}: {reply}"
                assert text.lower() in reply.message.lower(), f"{what}: {reply.message}"
                assert reply.failed_peer_id == peer.peer_id
            # Errors keep their type through call_*; the peer still answers afterwards.
            hidden = torch.zeros(1, h)
            with pytest.raises(ModelMismatch):
                await call_step(
                    p2p, peer.peer_id, StepRequest("z", 0, hidden, 0, 2, 8, "other"), timeout_s=10
                )
            with pytest.raises(CapacityError):
                await call_step(
                    p2p, peer.peer_id, StepRequest("z", 0, hidden, 0, 4, 8, model_hash), timeout_s=10
                )
            info = await call_info(p2p, peer.peer_id, maddrs=peer.maddrs)
            assert info.state == "serving" and info.active_sessions == 0
            # Past hivemind's 4 MiB unary cap both ways, which streams do not have. A probe's reply is at most
            # session.max_probe_reply_bytes (BIG_REPLY on this peer).
            big, back = 5 * 1024**2, int(BIG_REPLY)
            probe = ProbeRequest(payload=bytes(big), reply_bytes=back)
            reply = await call_probe(p2p, peer.peer_id, probe, maddrs=peer.maddrs, timeout_s=30)
            assert reply.received_bytes == big and len(reply.payload) == back
            with pytest.raises(ProtocolError, match="bytes back"):
                await call_probe(p2p, peer.peer_id, ProbeRequest(reply_bytes=big), timeout_s=30)
        assert peer.proc.poll() is None

    asyncio.run(run())


async def _ids_in_snapshot(directory: Directory) -> set[str]:
    return set((await directory.snapshot()).peers)


async def _killed_record_lifetime(directory: Directory, doomed: PeerProcess, limit_s: float) -> float:
    """Seconds from SIGKILLing `doomed` (once its record is seen) until its record is gone; fails past limit_s."""
    deadline = time.monotonic() + WAIT_S
    while doomed.peer_id not in await _ids_in_snapshot(directory):
        assert time.monotonic() < deadline, "the new peer never appeared"
        await asyncio.sleep(0.5)
    doomed.kill()
    killed = time.monotonic()
    while doomed.peer_id in await _ids_in_snapshot(directory):
        assert time.monotonic() - killed < limit_s, "the killed peer's record outlived its TTL"
        await asyncio.sleep(0.5)
    return time.monotonic() - killed


def test_killed_peer_disappears_after_its_ttl_and_sigterm_exits_cleanly(
    swarm: LocalSwarm, tiny: ModelSource
) -> None:
    doomed = swarm.start_peer(
        "0:6", name="doomed", extra_args=[*FIXED, "--record-ttl-s", str(TTL_S)], wait=False
    )
    leaver = swarm.start_peer(
        "0:6", name="leaver", extra_args=[*FIXED, "--shutdown-grace-s", "1"], wait=False
    )
    doomed.wait_ready(120)
    leaver.wait_ready(120)

    async def run() -> None:
        async with swarm_client(swarm.initial_peers, tiny.spec.weights_hash) as (_dht, directory, _p2p):
            # how soon it goes is test_killed_peers_record_goes_within_its_ttl's (wallclock); here, that it goes
            await _killed_record_lifetime(directory, doomed, limit_s=TTL_S + WAIT_S)
            assert leaver.stop(grace_s=30) == 0, leaver.log_tail()
            peers = (await directory.snapshot()).peers
            assert leaver.peer_id not in peers or peers[leaver.peer_id].state == "leaving"

    asyncio.run(run())


@pytest.mark.wallclock
def test_killed_peers_record_goes_within_its_ttl(swarm: LocalSwarm, tiny: ModelSource) -> None:
    doomed = swarm.start_peer(
        "0:6", name="doomed-wallclock", extra_args=[*FIXED, "--record-ttl-s", str(TTL_S)], wait=False
    )
    doomed.wait_ready(120)

    async def lifetime() -> float:
        async with swarm_client(swarm.initial_peers, tiny.spec.weights_hash) as (_dht, directory, _p2p):
            # the DHT drops a record at its expiry; 10 s more cover the snapshots' polls and reads
            return await _killed_record_lifetime(directory, doomed, limit_s=TTL_S + 10)

    assert asyncio.run(lifetime()) <= TTL_S + 10


def test_status_command_prints_the_live_swarm_as_json(swarm: LocalSwarm) -> None:
    result = subprocess.run(
        [*SWARM_PEER, "status", "--initial-peers", *swarm.initial_peers, "--model", "tiny", "--json"],
        capture_output=True,
        text=True,
        timeout=90,
        env={**os.environ, "FLOWSWARM_THREADS": "1"},
        start_new_session=True,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    data = json.loads(result.stdout)
    assert set(data) >= {"peers", "coverage", "planner", "plan"}
    ids = {p.peer_id for p in swarm.peers[:3]}
    listed = {p["peer_id"]: p for p in data["peers"]}
    assert ids <= set(listed)
    for pid in ids:
        entry = listed[pid]
        assert {
            "name",
            "range",
            "decode_tokens_s",
            "prefill_tokens_s",
            "free_cache_tokens",
            "active_sessions",
        } <= set(entry)
        assert entry["decode_tokens_s"] > 0 and entry["name"] in ("a", "b", "c")
        assert entry["background_bytes"]["announce"]["sent"] > 0  # its rpc_info's traffic by cause
    assert len(data["coverage"]) == 6 and min(data["coverage"]) >= 1
