"""OutputLog: what a session's hop sent on, cut back like the KV cache, read back exactly or not at all."""

from __future__ import annotations

import pytest
import torch

from swarm.errors import SessionError
from swarm.peer.outputs import OutputLog

pytestmark = pytest.mark.timeout(30)


def _states(tokens: int, first: int = 0) -> torch.Tensor:
    return torch.arange(first, first + tokens, dtype=torch.float32)[:, None].repeat(1, 4).to(torch.bfloat16)


def test_steps_in_order_are_read_back_bit_for_bit_in_their_dtype() -> None:
    log = OutputLog()
    log.record(0, 2, _states(5))
    log.record(5, 2, _states(1, 5))
    log.record(6, 2, _states(3, 6))
    assert log.length == 9
    got = log.read(0, 9, 2)
    assert got.dtype == torch.bfloat16 and torch.equal(got, _states(9))
    assert torch.equal(log.read(4, 3, 2), _states(3, 4))  # across parts


def test_a_step_below_the_length_cuts_the_log_back_like_the_cache() -> None:
    log = OutputLog()
    log.record(0, 2, _states(6))
    log.record(6, 2, _states(2, 6))
    log.record(3, 2, _states(2, 100))  # a retry from position 3 with other outputs
    assert log.length == 5
    assert torch.equal(log.read(0, 5, 2), torch.cat([_states(3), _states(2, 100)]))
    log.truncate(1)
    assert log.length == 1 and torch.equal(log.read(0, 1, 2), _states(1))


def test_a_gap_or_other_layers_empty_the_log_and_a_read_past_it_fails() -> None:
    log = OutputLog()
    log.record(0, 2, _states(4))
    with pytest.raises(SessionError, match="no log"):
        log.read(0, 5, 2)  # past its length
    with pytest.raises(SessionError, match="no log"):
        log.read(0, 4, 3)  # after other layers
    log.record(6, 2, _states(1, 6))  # positions 4 and 5 never came: nothing before 6 can be vouched for
    assert log.length == 0
    log.record(0, 2, _states(4))
    log.record(4, 3, _states(2))  # the session now runs other layers here
    assert (log.end, log.length) == (3, 0)


def test_the_log_copies_what_it_keeps() -> None:
    log, sent = OutputLog(), _states(3)
    log.record(0, 2, sent)
    sent.zero_()
    assert torch.equal(log.read(0, 3, 2), _states(3))
