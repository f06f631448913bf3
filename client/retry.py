"""Every retry decision of the client, in one place: what to do about an error, and whether to try again.

The session calls `decide(error, attempt)` after a failed step and acts on the answer; nothing else in the
client catches swarm errors to retry them. The mapping follows the tree in swarm/errors.py:

    PeerSilent      our own probe found a peer dead      -> withdraw it from routing, ban it, re-route, replay
    TransportError  peer silent or connection broken    -> find the silent hop, ban it, re-route, replay
    TimeoutError    our own step deadline passed         -> like TransportError
    WrongOutput     a spot-check caught a peer lying     -> re-route around it, replay (it is excluded already)
    ProtocolError   peer sent something malformed        -> ban the peer, re-route, replay
    CapacityError   peer full, leaving, or moved away    -> re-route around it for this session, replay; no ban:
                                                            it told the truth, and other sessions may still fit
    SessionMoved    peer handed our session's cache over -> FOLLOW: its successor takes the stage, same layers,
                                                            same position, no replay, no ban (the session
                                                            checks the successor is a live holder first,
                                                            else it is a plain SessionError)
    SessionError    peer forgot our session              -> route afresh from its stage, replay; no ban
    SessionEvicted  peer took our idle session's cache   -> (a SessionError) the same
    VersionMismatch, ModelMismatch, NoRouteError, other  -> give up at once (retrying cannot help)

A hop found silent (by PeerSilent, or when the session asks each hop after an error) is withdrawn: no route
of this client goes through it until its DHT record is refreshed after the death, however long a ban lasts.
Bans only deprioritise: client/routes.py routes through a banned peer when nobody else holds its layers.
When no peer holds some layers at all, the session waits for one (up to `route_wait_s`) instead of failing.

A ban that rests on a hop's word about a later hop (``failed_peer_id``) is checked first: client/session.py
asks the named peer directly and blames the claimant if it answers.

Every retry but FOLLOW replays the session's tokens from position 0, so greedy output is the same as without the failure.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass

from client.liveness import PeerSilent
from client.spot import WrongOutput
from swarm.errors import (
    CapacityError,
    ModelMismatch,
    NoRouteError,
    ProtocolError,
    SessionError,
    SessionMoved,
    TransportError,
    VersionMismatch,
)
from swarm.types import NodeID


class Action(enum.Enum):
    BAN_AND_REROUTE = "ban and re-route"  # ban the failed peer, rebuild the route from its stage on, replay
    REROUTE = "re-route"  # rebuild the route from the failed peer's stage, never through it again; no ban
    WITHDRAW = "withdraw"  # the peer is dead to us: out of routing until it re-announces; banned; re-route
    FOLLOW = (
        "follow"  # the failed peer moved our session to `successor`: swap it in, retry at the same position
    )
    REPLAY = "replay"  # rebuild the route from the failed peer's stage (it may be picked again), replay
    GIVE_UP = "give up"  # raise to the caller


@dataclass(frozen=True)
class Decision:
    action: Action
    failed_peer: NodeID | None
    delay_s: float = 0.0
    # The error cannot say which hop failed (a hop further down may have hung): ask each peer of the route
    # directly and blame the first silent one, so a healthy first hop is not banned for it.
    find_silent: bool = False
    successor: NodeID | None = None  # FOLLOW: the peer that holds the session now


@dataclass(frozen=True)
class RetryPolicy:
    """Bounds on retrying: at most `max_retries` failovers per step, with a doubling pause; a missing route is
    waited for up to `route_wait_s`, re-read every `route_poll_s`."""

    max_retries: int
    retry_delay_s: float
    route_wait_s: float = 0.0
    route_poll_s: float = 0.5

    def decide(self, error: BaseException, attempt: int, fallback_peer: NodeID | None = None) -> Decision:
        """What to do after `error` on try number `attempt` (0 for the first try).

        `fallback_peer` is the first peer of the route: a local timeout or broken stream cannot tell which
        hop failed, so the error is pinned on the hop the client talked to unless the error names one.
        """
        failed = _failed_peer(error) or fallback_peer
        if isinstance(error, asyncio.CancelledError) or attempt >= self.max_retries:
            return Decision(Action.GIVE_UP, failed)
        if isinstance(error, VersionMismatch | ModelMismatch | NoRouteError):
            return Decision(Action.GIVE_UP, failed)
        if isinstance(error, SessionMoved) and error.successor_id:
            return Decision(Action.FOLLOW, failed, successor=NodeID(error.successor_id))
        if isinstance(error, SessionError):
            return Decision(Action.REPLAY, failed)
        if isinstance(error, PeerSilent):  # first hand, just now: no pause, no need to ask again
            return Decision(Action.WITHDRAW, failed)
        delay_s = self.retry_delay_s * (2**attempt)
        if isinstance(error, WrongOutput):
            return Decision(Action.REROUTE, failed)
        if isinstance(error, CapacityError):
            return Decision(Action.REROUTE, failed, delay_s)
        if isinstance(error, ProtocolError):
            return Decision(Action.BAN_AND_REROUTE, failed, delay_s)
        if isinstance(error, TransportError | TimeoutError | ConnectionError):
            return Decision(Action.BAN_AND_REROUTE, failed, delay_s, find_silent=True)
        return Decision(Action.GIVE_UP, failed)


def _failed_peer(error: BaseException) -> NodeID | None:
    peer = getattr(error, "failed_peer_id", None)
    return NodeID(str(peer)) if peer else None
