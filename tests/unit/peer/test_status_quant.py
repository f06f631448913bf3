"""``swarm-peer status``: each peer's --quant, in the JSON document and in the printed lines."""

from __future__ import annotations

import pytest

from swarm.dht import SwarmSnapshot
from swarm.peer.cli import _print_status, snapshot_json
from tests.unit.dht.records import peer_record


def test_status_shows_each_peers_quant(capsys: pytest.CaptureFixture[str]) -> None:
    records = [peer_record("QmPlainPeer01", 0, 4), peer_record("QmFourBitPeer", 4, 8, quant="nf4")]
    snapshot = SwarmSnapshot(
        peers={r.peer_id: r for r in records}, plan=None, planner_peer_id=None, fetched_at=0.0
    )
    data = snapshot_json(snapshot, 8)
    assert [p["quant"] for p in data["peers"]] == ["none", "nf4"]  # type: ignore[index, union-attr]
    _print_status(data)
    lines = capsys.readouterr().out.splitlines()
    assert " nf4 decode " in lines[2] and " nf4 " not in lines[1], lines
