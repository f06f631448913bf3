"""Spot-checks: a sampled fraction of steps is re-run on another peer holding the same layers, and compared.

Design. A peer's KV cache of our session lives only on that peer, so a decode step cannot be re-run elsewhere
as it is: another peer would need the whole prefix of that stage's inputs, which the client never sees (each
hop forwards to the next). Rather than split every step at a stage to record its inputs (an extra client round
trip on every token), a sampled step is checked by a *separate prefill* that both peers compute from the same
bytes:

    window  = the session's newest `window_tokens` tokens (this step's included)
    inputs  = embed(window) run through the route's stages before the checked one, as a fresh session
    suspect = the checked stage's peer on `inputs`, alone, in a fresh session at position 0
    checker = another holder of those layers, on the very same `inputs`, the same way

Both answers come from identical inputs at identical positions, so honest peers agree up to rounding; the
comparison allows for the looser of the two answers' dtypes (see `tolerance`). Nothing of the real session is
touched: with honest peers its outputs are bit for bit those of a run without checks, and the check costs one
prefill of `window_tokens` per peer involved, whatever the session's length. To the suspect the check looks
like any client's new session.

A mismatch is re-checked once before anyone is blamed (the same inputs again, to both peers, and to a third
holder when there is one): an honest peer is deterministic on the same input, so a peer whose two answers
differ is lying (it adds noise); with a third holder, the majority decides. A peer found lying is excluded by
this client for good (routes avoid it), banned in the shared ban list and reported through the `ReportSink`.
If two self-consistent peers still disagree and no third holder exists, nobody can tell which one lies:
nobody is blamed, and a warning is logged.
"""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
from collections import Counter
from collections.abc import Sequence
from typing import Protocol

import torch

from swarm.dht import Directory, ReportRecord
from swarm.dht.schemas import MAX_REASON_CHARS
from swarm.errors import ProtocolError, SwarmError
from swarm.routing.route import Stage
from swarm.types import LayerRange, NodeID, SessionID

logger = logging.getLogger(__name__)

# Relative error ||a - b|| / max(||a||, ||b||) two honest answers may show, by the looser dtype of the two.
# Peers may run other kernels (CPU vs GPU, other batch shapes), so this is a few units of the dtype's rounding
# accumulated over a stage's layers; injected faults and real corruption are orders of magnitude larger.
TOLERANCE = {torch.float32: 2e-3, torch.float16: 1e-2, torch.bfloat16: 5e-2}


class WrongOutput(ProtocolError):
    """A peer of the route computed wrong outputs (a spot-check confirmed it); it is excluded already."""


class ReportSink(Protocol):
    """Where confirmed wrong outputs are reported (the lead wires the DHT's signed reports here)."""

    async def report(self, accused_peer_id: NodeID, layers: LayerRange, reason: str) -> None: ...


class DirectoryReports:
    """Publishes each confirmed wrong output as a signed ReportRecord in the swarm's DHT, where the planner and
    other clients leave out a peer reported by enough distinct reporters."""

    def __init__(self, directory: Directory) -> None:
        self.directory = directory

    async def report(self, accused_peer_id: NodeID, layers: LayerRange, reason: str) -> None:
        record = ReportRecord(
            reporter_peer_id=self.directory.peer_id,
            accused_peer_id=str(accused_peer_id),
            layers=[layers.start, layers.end],
            reason=reason[:MAX_REASON_CHARS],
            created_at=self.directory.dht.now(),
        )
        try:
            async with asyncio.timeout(10):
                stored = await self.directory.publish_report(record)
        except Exception as e:  # the client already excludes the peer itself; the report is for everyone else
            logger.warning("could not publish the report on %s: %r", str(accused_peer_id)[-8:], e)
            return
        logger.info(
            "reported %s for wrong outputs on layers %s (stored: %s)",
            str(accused_peer_id)[-8:],
            layers,
            stored,
        )


class NoReports:
    """The default sink: reports go nowhere (the client still excludes the peer itself)."""

    async def report(self, accused_peer_id: NodeID, layers: LayerRange, reason: str) -> None:
        return None


class CheckChain(Protocol):
    """What a spot-check needs of the chain (client.session.Chain adds finding a silent hop)."""

    async def step(
        self,
        session_id: SessionID,
        stages: Sequence[Stage],
        position: int,
        hidden: torch.Tensor,
        max_length_tokens: int,
    ) -> torch.Tensor: ...  # hidden[T, H] after the last stage

    async def close(self, session_id: SessionID, stages: Sequence[Stage]) -> None: ...

    async def run_alone(self, stage: Stage, hidden: torch.Tensor) -> torch.Tensor: ...


class Holders(Protocol):
    async def holders(self, layers: LayerRange) -> list[NodeID]: ...  # live, unbanned peers holding `layers`

    def ban(self, peer_id: NodeID) -> None: ...


class Embed(Protocol):
    def embed(self, ids: torch.Tensor) -> torch.Tensor: ...


def tolerance(*dtypes: torch.dtype) -> float:
    return max(TOLERANCE.get(d, TOLERANCE[torch.bfloat16]) for d in dtypes)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a32, b32 = a.float(), b.float()
    if a32.shape != b32.shape or not (a32.isfinite().all() and b32.isfinite().all()):
        return float("inf")
    scale = max(float(a32.norm()), float(b32.norm()), 1e-6)
    return float((a32 - b32).norm()) / scale


def agree(a: torch.Tensor, b: torch.Tensor) -> bool:
    return relative_error(a, b) <= tolerance(a.dtype, b.dtype)


class SpotChecker:
    """Decides which steps to check, runs the checks, and excludes and reports peers found lying."""

    def __init__(
        self,
        chain: CheckChain,
        routes: Holders,
        head: Embed,
        *,
        rate: float,
        window_tokens: int,
        reports: ReportSink | None = None,
        rng: random.Random | None = None,
        timeout_s: float = 30.0,
    ) -> None:
        self.chain = chain
        self.routes = routes
        self.head = head
        self.rate = rate
        self.window_tokens = window_tokens
        self.reports = reports or NoReports()
        self.rng = rng or random.Random()
        self.timeout_s = timeout_s
        self.excluded: set[NodeID] = set()  # peers found lying: no route of this client goes through them
        self.steps_served: Counter[NodeID] = Counter()  # real steps each peer served (for tests and reports)
        self.checks_run = 0

    def due(self) -> bool:
        """Whether to check the step just taken (a fresh draw each step)."""
        return self.rate > 0 and self.rng.random() < self.rate

    async def check(self, stages: Sequence[Stage], token_ids: Sequence[int]) -> NodeID | None:
        """Re-run one checkable stage of `stages` on the newest tokens; the peer found lying, or None."""
        window = list(token_ids[-self.window_tokens :])
        try:
            async with asyncio.timeout(self.timeout_s):
                pick = await self._pick(stages)
                if pick is None:
                    return None  # no stage has another holder: nothing to compare with
                index, checkers = pick
                self.checks_run += 1
                inputs = await self._inputs(stages[:index], window)
                liar = await self._verdict(stages[index], checkers, inputs)
        except (SwarmError, TimeoutError, ConnectionError, OSError) as error:
            # a check that cannot run proves nothing; failures of the real route are the session's business
            logger.info("spot-check skipped: %s: %s", type(error).__name__, error)
            return None
        if liar is not None:
            await self._exclude(liar, stages[index].layers)
        return liar

    async def _pick(self, stages: Sequence[Stage]) -> tuple[int, list[NodeID]] | None:
        """A random stage that another holder can check, with its checkers in random order."""
        options = []
        for index, stage in enumerate(stages):
            others = [p for p in await self.routes.holders(stage.layers) if p != stage.peer_id]
            others = [p for p in others if p not in self.excluded]
            if others:
                self.rng.shuffle(others)
                options.append((index, others))
        return self.rng.choice(options) if options else None

    async def _inputs(self, upstream: Sequence[Stage], window: list[int]) -> torch.Tensor:
        """The checked stage's input for `window`: embeddings through the stages before it (a fresh session)."""
        hidden = self.head.embed(torch.tensor(window, dtype=torch.long)).float()
        if not upstream:
            return hidden
        session_id = SessionID(secrets.token_hex(16))
        try:
            return await self.chain.step(session_id, upstream, 0, hidden, len(window))
        finally:
            await _close_quietly(self.chain, session_id, upstream)

    async def _verdict(self, stage: Stage, checkers: list[NodeID], inputs: torch.Tensor) -> NodeID | None:
        suspect, checker = stage.peer_id, checkers[0]
        first = await self._answers([suspect, checker], stage.layers, inputs)
        if agree(first[suspect], first[checker]):
            return None
        # Re-check once before blaming anyone: a one-off mismatch may be noise (or the checker lying).
        asked = [suspect, checker, *checkers[1:2]]
        second = await self._answers(asked, stage.layers, inputs)
        liars = [p for p in (suspect, checker) if not agree(first[p], second[p])]  # honest = deterministic
        if len(asked) == 3:  # a third holder referees: whoever it sides against is outvoted
            sides = {p: agree(second[p], second[asked[2]]) for p in (suspect, checker)}
            if any(sides.values()):  # (if it sides with neither, it may be the liar: no majority)
                liars = [p for p in (suspect, checker) if p in liars or not sides[p]]
        if not liars:
            logger.warning(
                "peers %s and %s disagree on layers %s and nobody else holds them: cannot tell who lies",
                suspect[-8:],
                checker[-8:],
                stage.layers,
            )
            return None
        # both lying is possible; the suspect is the one on our route, so it goes first
        for extra in liars[1:]:
            await self._exclude(extra, stage.layers)
        return liars[0]

    async def _answers(
        self, peers: list[NodeID], layers: LayerRange, inputs: torch.Tensor
    ) -> dict[NodeID, torch.Tensor]:
        outputs = await asyncio.gather(*(self.chain.run_alone(Stage(p, layers), inputs) for p in peers))
        return dict(zip(peers, outputs, strict=True))

    async def _exclude(self, peer_id: NodeID, layers: LayerRange) -> None:
        if peer_id in self.excluded:
            return
        self.excluded.add(peer_id)
        self.routes.ban(peer_id)
        logger.warning("spot-check: peer %s computes layers %s wrongly; excluded", peer_id[-8:], layers)
        try:
            await self.reports.report(peer_id, layers, "spot-check: output differs from other holders")
        except Exception as error:  # a report that cannot be published must not fail the user's request
            logger.warning("could not report peer %s: %r", peer_id[-8:], error)


async def _close_quietly(chain: CheckChain, session_id: SessionID, stages: Sequence[Stage]) -> None:
    try:
        await chain.close(session_id, stages)
    except (SwarmError, TimeoutError, ConnectionError, OSError) as error:
        logger.info("closing check session %s: %s", session_id[:8], error)
