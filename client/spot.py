"""Spot-checks: a sampled fraction of steps is re-run on another peer holding the same layers, and compared.

Design. A peer's KV cache of our session lives only on that peer, so a decode step cannot be re-run elsewhere
as it is: another peer would need the whole prefix of that stage's inputs, which the client never sees (each
hop forwards to the next). Rather than split every step at a stage to record its inputs (an extra client round
trip on every token), a sampled step is checked by *separate prefills* of the same bytes, in fresh sessions
at position 0:

    window  = the session's newest `window_tokens` tokens (this step's included)
    staged  = embed(window) through the route's stages one by one, each alone, the client relaying
              (staged[i] = stage i's input, staged[-1] the route's answer)
    stage check: one random stage with another holder: that holder on staged[i], vs the stage's own answer
    route check: the route forwarded peer to peer on staged[0], vs staged[-1]

Both answers of a comparison come from identical inputs at identical positions, so honest peers agree up to
rounding; the comparison allows for the looser of the two answers' dtypes (see `tolerance`). Nothing of the
real session is touched: with honest peers its outputs are bit for bit those of a run without checks. A check
costs one prefill of `window_tokens` per stage run alone, one by the checker, and one forwarded prefill of the
route, whatever the session's length (scripts/bench_spot_check.py measures it). To a peer every check looks
like any client's new session.

Stage check. A mismatch is re-checked once before anyone is blamed (the same inputs again, to both peers, and
to a third holder when there is one): an honest peer is deterministic on the same input, so a peer whose two
answers differ is lying (it adds noise); with a third holder, the majority decides. If two self-consistent
peers still disagree and no third holder exists, nobody can tell which one lies: nobody is blamed, and a
warning is logged.

Route check. It catches a hop that is honest alone but lies on the route: it skips the hops after it (returns
its own output, with made-up timings for them) or is wrong when another peer, not the client, calls it. On a
mismatch each pair of consecutive hops is forwarded on its staged input; the first pair that differs is
settled with substitutes (see `_blame_pair`): a hop is blamed only if the pair still differs with its partner
replaced by another holder. When no substitute exists, this client avoids both hops, without a report.

A peer found lying is excluded by this client for good (routes avoid it), banned in the shared ban list and
reported through the `ReportSink`.
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
        *,
        relayed: bool = False,
        batch: tuple[str, int] = ("", 1),
    ) -> torch.Tensor: ...  # hidden[T, H] after the last stage (relayed: each hop answers its caller; batch:

    # (id, size) of the client's decode steps of other sessions sent with this one, StepRequest.batch_id)

    async def close(self, session_id: SessionID, stages: Sequence[Stage]) -> None: ...

    async def run_alone(self, stage: Stage, hidden: torch.Tensor) -> torch.Tensor: ...


class Holders(Protocol):
    # live, unbanned peers holding `layers`; with `like`, only those holding their weights as it does (--quant)
    async def holders(self, layers: LayerRange, like: NodeID | None = None) -> list[NodeID]: ...

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
        blocking: bool = False,
    ) -> None:
        self.chain = chain
        self.routes = routes
        self.head = head
        self.rate = rate
        self.window_tokens = window_tokens
        self.reports = reports or NoReports()
        self.rng = rng or random.Random()
        self.timeout_s = timeout_s
        self.blocking = blocking  # see ClientConfig.spot_check_blocking
        self._running: set[asyncio.Task[NodeID | None]] = set()  # checks started with `start`
        # found lying, or half of a pair avoided: no route of this client goes through them
        self.excluded: set[NodeID] = set()
        # forwarding pairs whose route answer was wrong when no substitute could tell which of the two lied
        self.avoided_pairs: list[tuple[NodeID, NodeID]] = []
        self.steps_served: Counter[NodeID] = Counter()  # real steps each peer served (for tests and reports)
        self.checks_run = 0

    def due(self) -> bool:
        """Whether to check the step just taken (a fresh draw each step)."""
        return self.rate > 0 and self.rng.random() < self.rate

    def start(self, stages: Sequence[Stage], token_ids: Sequence[int]) -> asyncio.Task[NodeID | None]:
        """Run `check` beside the session's next steps. A liar it finds joins `excluded`, which every session
        looks at after each step (InferenceSession._spot_check), so the failover starts at the next step."""
        task = asyncio.create_task(self.check(tuple(stages), tuple(token_ids)))
        self._running.add(task)  # a strong reference: the loop keeps only weak ones
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[NodeID | None]) -> None:
        self._running.discard(task)
        if not task.cancelled() and task.exception() is not None:  # check() returns None for swarm failures
            logger.error("spot-check failed", exc_info=task.exception())

    @property
    def running(self) -> int:
        """Checks started with `start` and not finished."""
        return len(self._running)

    async def aclose(self) -> None:
        """Cancel the checks still running (the client is closing)."""
        for task in list(self._running):
            task.cancel()
        await asyncio.gather(*self._running, return_exceptions=True)

    async def check(self, stages: Sequence[Stage], token_ids: Sequence[int]) -> NodeID | None:
        """Check the route on the newest tokens: one stage against another holder, then the route as forwarded
        against the same stages run one by one. The peer found lying (or the first of a pair avoided), or None.
        """
        window = list(token_ids[-self.window_tokens :])
        try:
            async with asyncio.timeout(self.timeout_s):
                self.checks_run += 1
                hidden = self.head.embed(torch.tensor(window, dtype=torch.long)).float()
                staged, forwarded = await self._runs(stages, hidden)
                liar = await self._stage_check(stages, staged)
                if liar is None and forwarded is not None:
                    liar = await self._route_check(stages, staged, forwarded)
        except (SwarmError, TimeoutError, ConnectionError, OSError) as error:
            # a check that cannot run proves nothing; failures of the real route are the session's business
            logger.info("spot-check skipped: %s: %s", type(error).__name__, error)
            return None
        return liar

    async def _runs(
        self, stages: Sequence[Stage], hidden: torch.Tensor
    ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """The route stage by stage (see `_staged`) and, for two hops or more, forwarded (None for one hop: it
        forwards nothing). Both at once: they wait on different peers, so a check costs the user less time."""
        if len(stages) < 2:
            return await self._staged(stages, hidden), None
        try:
            async with asyncio.TaskGroup() as group:
                staged = group.create_task(self._staged(stages, hidden))
                forwarded = group.create_task(self._forwarded(stages, hidden))
        except ExceptionGroup as failed:  # the caller tells a failed check by the error's type
            raise failed.exceptions[0] from None
        return staged.result(), forwarded.result()

    async def _staged(self, stages: Sequence[Stage], hidden: torch.Tensor) -> list[torch.Tensor]:
        """Each stage alone, the client relaying: staged[i] is stage i's input, staged[-1] the route's output."""
        staged = [hidden]
        for stage in stages:
            staged.append(await self.chain.run_alone(stage, staged[-1]))
        return staged

    async def _forwarded(self, stages: Sequence[Stage], hidden: torch.Tensor) -> torch.Tensor:
        """`stages` as one forwarded step from position 0 in a fresh session (closed after): peer to peer."""
        session_id = SessionID(secrets.token_hex(16))
        try:
            # Relayed, each hop answering its caller: that is the path on which a hop could answer for the hops
            # after it (on the default path the last hop answers the client directly)
            return await self.chain.step(session_id, stages, 0, hidden, hidden.shape[0], relayed=True)
        finally:
            await _close_quietly(self.chain, session_id, stages)

    async def _stage_check(self, stages: Sequence[Stage], staged: list[torch.Tensor]) -> NodeID | None:
        """One random stage that has another holder, against that holder on the same input."""
        pick = await self._pick(stages)
        if pick is None:
            return None  # no stage has another holder: nothing to compare with
        index, checkers = pick
        stage = stages[index]
        liar = await self._verdict(stage, checkers, staged[index], staged[index + 1])
        if liar is not None:
            await self._exclude(liar, stage.layers, "spot-check: output differs from other holders")
        return liar

    async def _others(self, stage: Stage) -> list[NodeID]:
        """Other holders of `stage`'s layers that this client still trusts and that hold their weights as the
        stage's peer does (an nf4 peer's honest answer is not a float16 peer's), in random order."""
        others = [
            p for p in await self.routes.holders(stage.layers, like=stage.peer_id) if p != stage.peer_id
        ]
        others = [p for p in others if p not in self.excluded]
        self.rng.shuffle(others)
        return others

    async def _pick(self, stages: Sequence[Stage]) -> tuple[int, list[NodeID]] | None:
        """A random stage that another holder can check, with its checkers in random order."""
        options = []
        for index, stage in enumerate(stages):
            others = await self._others(stage)
            if others:
                options.append((index, others))
        return self.rng.choice(options) if options else None

    async def _verdict(
        self, stage: Stage, checkers: list[NodeID], inputs: torch.Tensor, answer: torch.Tensor
    ) -> NodeID | None:
        """Whom to blame when `stage` answered `answer` on `inputs`: nobody if the first checker agrees."""
        suspect, checker = stage.peer_id, checkers[0]
        first = {suspect: answer, **await self._answers([checker], stage.layers, inputs)}
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
            await self._exclude(extra, stage.layers, "spot-check: output differs from other holders")
        return liars[0]

    async def _answers(
        self, peers: list[NodeID], layers: LayerRange, inputs: torch.Tensor
    ) -> dict[NodeID, torch.Tensor]:
        outputs = await asyncio.gather(*(self.chain.run_alone(Stage(p, layers), inputs) for p in peers))
        return dict(zip(peers, outputs, strict=True))

    async def _route_check(
        self, stages: Sequence[Stage], staged: list[torch.Tensor], forwarded: torch.Tensor
    ) -> NodeID | None:
        """The route as `forwarded` vs stage by stage (`staged`); on a mismatch, the pair of hops that breaks it.

        Every stage was honest alone (or the stage check would have said), so a mismatch is a hop that lies
        when it forwards, or when it is forwarded to: each pair of consecutive hops, forwarded on its staged
        input, is compared with the staged answer, and the first pair that differs is handed to `_blame_pair`.
        """
        if agree(forwarded, staged[-1]):
            return None
        for i in range(len(stages) - 1):
            pair = stages[i : i + 2]
            if not agree(await self._forwarded(pair, staged[i]), staged[i + 2]):
                return await self._blame_pair(pair, staged[i], staged[i + 1], staged[i + 2])
        logger.warning(
            "route %s answers differently forwarded than stage by stage, but no pair of hops does again",
            " -> ".join(s.peer_id[-8:] for s in stages),
        )
        return None

    async def _blame_pair(
        self, pair: Sequence[Stage], x: torch.Tensor, y: torch.Tensor, z: torch.Tensor
    ) -> NodeID | None:
        """`pair` = (first, second) forwarded on `x` differs from first alone (`y`) then second alone (`z`).

        A hop is blamed only if the mismatch follows it to a pair whose other hop is a substitute: another
        holder whose answer alone agrees with the staged one. Honest peers are deterministic, so an honest hop
        paired with an honest substitute cannot differ; no random or targeted lie of one hop can get the other
        blamed. When no substitute settles it, nobody is blamed: this client avoids both, with no report."""
        first, second = pair
        liars = []
        sub = await self._substitute(second, y, z)
        if sub is not None and not agree(await self._forwarded([first, sub], x), z):
            liars.append(first)
        sub = await self._substitute(first, x, y)
        if sub is not None and not agree(await self._forwarded([sub, second], x), z):
            liars.append(second)
        for liar in liars:
            await self._exclude(liar.peer_id, liar.layers, "spot-check: route forwarded through it is wrong")
        if liars:
            return liars[0].peer_id
        self.excluded.update((first.peer_id, second.peer_id))
        self.avoided_pairs.append((first.peer_id, second.peer_id))
        logger.warning(
            "spot-check: forwarding %s -> %s gives a wrong answer and no other holder tells which lies: "
            "this client avoids both (no report)",
            first.peer_id[-8:],
            second.peer_id[-8:],
        )
        return first.peer_id

    async def _substitute(self, stage: Stage, inputs: torch.Tensor, expected: torch.Tensor) -> Stage | None:
        """Another holder of `stage`'s layers whose answer alone on `inputs` agrees with `expected` (at most
        two are tried, to bound the cost), or None."""
        for peer_id in (await self._others(stage))[:2]:
            candidate = Stage(peer_id, stage.layers)
            if agree(await self.chain.run_alone(candidate, inputs), expected):
                return candidate
        return None

    async def _exclude(self, peer_id: NodeID, layers: LayerRange, reason: str) -> None:
        if peer_id in self.excluded:
            return
        self.excluded.add(peer_id)
        self.routes.ban(peer_id)
        logger.warning("%s: peer %s on layers %s; excluded", reason, peer_id[-8:], layers)
        try:
            await self.reports.report(peer_id, layers, reason)
        except Exception as error:  # a report that cannot be published must not fail the user's request
            logger.warning("could not report peer %s: %r", peer_id[-8:], error)


async def _close_quietly(chain: CheckChain, session_id: SessionID, stages: Sequence[Stage]) -> None:
    try:
        await chain.close(session_id, stages)
    except (SwarmError, TimeoutError, ConnectionError, OSError) as error:
        logger.info("closing check session %s: %s", session_id[:8], error)
