"""Bans with exponential backoff on an injected clock."""

from __future__ import annotations

import pytest

from swarm.routing import BanConfig, BanList
from swarm.types import NodeID

pytestmark = pytest.mark.timeout(10)


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def test_ban_expires_with_exponential_backoff() -> None:
    clock = FakeClock()
    bans = BanList(clock, BanConfig(base_s=1.0, factor=2.0, max_s=5.0, forget_after_s=60.0))
    peer = NodeID("p1")
    assert [bans.ban(peer) for _ in range(5)] == [1.0, 2.0, 4.0, 5.0, 5.0]
    assert bans.is_banned(peer)
    clock.now_s += 4.9
    assert bans.is_banned(peer)
    clock.now_s += 0.2
    assert not bans.is_banned(peer)
    assert bans.failures(peer) == 5
    assert bans.ban(peer) == 5.0  # still remembered: the ban stays at the cap


def test_success_and_quiet_spell_forget_failures() -> None:
    clock = FakeClock()
    bans = BanList(clock, BanConfig(base_s=1.0, max_s=30.0, forget_after_s=10.0))
    peer = NodeID("p1")
    bans.ban(peer)
    bans.ban(peer)
    bans.succeeded(peer)
    assert not bans.is_banned(peer) and bans.ban(peer) == 1.0
    bans.ban(peer)  # 2 s
    clock.now_s += 2.0 + 10.0
    assert bans.failures(peer) == 0
    assert bans.ban(peer) == 1.0


def test_bad_config_is_a_clear_error() -> None:
    with pytest.raises(ValueError):
        BanConfig(base_s=0.0)
    with pytest.raises(ValueError):
        BanConfig(factor=0.5)
