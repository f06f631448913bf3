"""One session on this peer, and everything of it in one place.

A ``Session`` lives in its range's table (``Served.sessions``, owned by ``Peer``, swarm/peer/state.py) from its
first step to its close, and holds all this peer keeps of it: who opened it and its reservation, the outputs it
sent on (swarm/peer/outputs.py), the executor's bookkeeping of its steps (its turn and its failed step,
swarm/peer/executor.py) and its hand-over state (swarm/peer/handover.py): frozen while its cache is sent away,
its steps in flight, a cache coming in chunk by chunk. Its KV cache is in its range's BlockRange under the same
key. Closing it (``Peer.close``) frees the cache and drops the object, and with it everything else: there is no
other table of sessions with a cap of its own.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from swarm.peer.executor import SessionSteps
from swarm.peer.outputs import OutputLog
from swarm.types import LayerRange


@dataclass
class Incoming:
    """A session's cache being handed to us chunk by chunk (HandoverRequest): what the next chunk must be."""

    layers: LayerRange
    position: int
    layer: int  # the chunk expected next
    token: int


@dataclass
class HandoverState:
    """A session's side of hand-over (swarm/peer/handover.py)."""

    frozen: asyncio.Future[None] | None = None  # set while its cache is sent away: new steps wait for it
    in_flight: int = 0  # its steps computing now (a hand-over waits for them to end)
    incoming: Incoming | None = None  # set while its cache comes in from a peer that hands it over
    # layers already handed over in parts (a stage split between decode peers): each goes once, so a client
    # cannot have us send one session's cache again and again, each copy charged to our share elsewhere
    parted: set[int] = field(default_factory=set)


@dataclass(eq=False)
class Session:
    owner: str  # the remote peer that opened it here: a client, or the previous hop of its route
    max_length_tokens: int
    opened_s: float  # the Peer's clock
    last_used_s: float
    sent: OutputLog = field(default_factory=OutputLog)  # what it sent on, for a failover's resend
    steps: SessionSteps = field(default_factory=SessionSteps)  # the executor's bookkeeping of its steps
    handover: HandoverState = field(default_factory=HandoverState)
