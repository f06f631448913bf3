"""An inference session over a route of peers, with failover by re-route and replay.

The client keeps the embeddings and the LM head; the peers keep one KV cache per session, opened implicitly by
the first step. The session remembers every token the peers have seen (prompt plus generated), so whatever
goes wrong on the way it can rebuild the peers' caches: after a failed step it builds a new route for the
layers from the failed peer's stage on (the stages before it stay: their peers are alive and hold the cache),
and refills only the stages that are new to the session (`_replay`): the kept stage before them resends the
outputs it logged, or the client sends the embeddings where there is none. Stages after them that the new
route kept (same peer, same layers) keep their caches too, so nothing is computed again by a peer that still
holds the session. Greedy decoding after a failover therefore gives the same tokens as an uninterrupted run.
After every good step the route's peers are reported as having served, which forgets their past failures.
A sampled fraction of good steps is spot-checked first (client/spot.py): a peer found computing wrongly is
excluded, and the step is replayed without it, like any other failover.

The same session runs over the remote chain of peers (client.chain) and over in-process block ranges
(client.local), which is how the tests and benchmarks compare it with transformers.

A step that runs long makes the session probe its route's peers (client/liveness.py), so a dead hop is noticed
in about a second rather than at the step timeout; a peer seen dead is withdrawn from routing (client/routes.py).
When no live peer holds some layers (a holder restarting, a late join), building the route waits for one,
up to the policy's `route_wait_s`, instead of failing the request at once.

Who decides what is not here: client/retry.py maps each error to an action, and this module only acts on it."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from client.chunks import chunked
from client.drafting import Speculation
from client.liveness import StepWatch
from client.retry import Action, Decision, RetryPolicy
from client.split import Move, cut, moved_route, plan_moves
from client.spot import CheckChain, SpotChecker, WrongOutput
from swarm.errors import NoRouteError, SessionError, SwarmError
from swarm.routing.route import Route, Stage, route_text
from swarm.types import SOURCE, LayerRange, NodeID, SessionID

logger = logging.getLogger(__name__)
ROUTE_WAIT_LOG_S = 5.0  # while waiting for a route, log progress this often


class Head(Protocol):
    """The client-side ends of the model: token embeddings and the final norm + LM head."""

    @property
    def hidden_size(self) -> int: ...  # H

    def embed(self, ids: torch.Tensor) -> torch.Tensor: ...  # ids[T] -> hidden[T, H]

    # hidden[T, H] -> logits[T, V]; argmax_only: only each row's argmax must be exact, entries that cannot be it
    # may be -inf (swarm.models.backends.cpu.argmax)
    def logits(self, hidden: torch.Tensor, argmax_only: bool = False) -> torch.Tensor: ...


class Chain(CheckChain, Protocol):
    """Carries hidden states through the stages of a route; remotely, each peer forwards to the next."""

    async def find_silent(self, stages: Sequence[Stage], timeout_s: float) -> NodeID | None: ...

    # stages[0] sends the outputs it logged for positions [position, +tokens) on through stages[1:], computing
    # nothing itself (a failover refilling the stages it replaced); SessionError if it has no such log
    async def resend(
        self,
        session_id: SessionID,
        stages: Sequence[Stage],
        position: int,
        tokens: int,
        hidden_size: int,
        max_length_tokens: int,
    ) -> None: ...

    # stage's peer hands the session's cache for its layers (or only ``part`` of them, keeping the session) to
    # ``target`` (the decode route, client.split): the session's position, now held there, and the KV bytes
    # sent; on any error the session stays on the stage
    async def move(
        self,
        session_id: SessionID,
        stage: Stage,
        target: NodeID,
        timeout_s: float,
        part: LayerRange | None = None,
    ) -> tuple[int, int]: ...


class RouteSource(Protocol):
    """Builds routes (or their tails, for failover), and remembers which peers failed and which served."""

    async def route(
        self,
        start_layer: int,
        prev: NodeID,
        session_tokens: int,
        avoid: frozenset[NodeID] = frozenset(),
        session_id: str = "",
    ) -> Route: ...  # never through a peer in `avoid`; NoRouteError names the layers nobody else serves

    def release(self, session_id: str) -> None: ...  # the session closed: routes of others stop counting it

    # the route to decode on after the prompt (the plan's decode flows), or None: decode where it prefilled
    async def decode_route(
        self, session_tokens: int, avoid: frozenset[NodeID] = frozenset()
    ) -> Route | None: ...

    # live, unbanned peers holding `layers`; with `like`, only those holding their weights as it does (--quant)
    async def holders(self, layers: LayerRange, like: NodeID | None = None) -> list[NodeID]: ...

    def ban(self, peer_id: NodeID) -> None: ...  # deprioritise: used only where nobody else holds its layers

    def withdraw(self, peer_id: NodeID) -> None: ...  # seen dead: never route to it until it re-announces

    def succeeded(self, peer_ids: Iterable[NodeID]) -> None: ...  # they served a step: forget their failures


@dataclass(frozen=True)
class Failover:
    """One failover of a session, for logs, tests and benchmarks."""

    error: str  # the error's type name
    peer: NodeID  # whom the session acted against
    action: Action
    detected_by: str  # "probe": our probe during the step; "asked": asked each hop after the error; "error"
    at_s: float  # time.monotonic() when the session acted


NO_BATCH = ("", 1)  # a step sent alone


@dataclass(frozen=True)
class Replay:
    """One refill of the stages a failover replaced, for logs, tests and benchmarks."""

    stages: Route  # the stages that computed the session's tokens again
    tokens: int  # how many tokens each of them computed
    resent_by: (
        NodeID | None
    )  # the kept stage that sent its logged outputs on; None: the client sent embeddings


class InferenceSession:
    """One sequence being generated: call `forward(new_ids)` with the prompt, then with each new token."""

    def __init__(
        self,
        chain: Chain,
        routes: RouteSource,
        head: Head,
        policy: RetryPolicy,
        step_timeout_s: float,
        max_length_tokens: int,
        checker: SpotChecker | None = None,
        watch: StepWatch | None = None,
        prefill_chunk_tokens: int = 0,
    ) -> None:
        self.chain = chain
        self.routes = routes
        self.head = head
        self.full_head = head  # scores every position of a step (BatchedSession's head keeps only the last)
        self.policy = policy
        self.step_timeout_s = step_timeout_s
        self.max_length_tokens = max_length_tokens  # KV cache reserved on each peer: prompt + new tokens
        self.session_id = SessionID(secrets.token_hex(16))
        self.token_ids: list[int] = []  # every token the peers' caches hold, in order
        self.stages: Route = ()
        self.failovers = 0  # how many times a step was retried on a new route or replayed
        self.avoided: set[NodeID] = set()  # peers that could not take this session (full, leaving, moved)
        self.checker = checker  # spot-checks a sampled fraction of steps (None: no checks)
        self.watch = watch or StepWatch(chain.find_silent)  # probes the route when a step runs long
        self.failover_log: list[Failover] = []
        self.route_waits = 0  # how many times building a route found layers nobody serves, and waited
        # What failovers cost the swarm: tokens computed again, summed over the stages that computed them (a
        # replay of 100 tokens through 2 stages counts 200)
        self.replayed_tokens = 0
        self.replays: list[Replay] = []
        self._filled: set[Stage] = set()  # stages of the route whose caches hold all of token_ids
        # Send the next step relayed (set after a failover or a follow): our wait for its position may still
        # stand at the last hop, and would take the retried step meant for a new wait.
        self._relay_once = False
        self.sleep = asyncio.sleep  # every pause of the failover (tests replace it to act while it waits)
        self.prefill_chunk_tokens = prefill_chunk_tokens  # pipeline longer steps in chunks (0: never)
        self._closed = False
        self._check: asyncio.Task[NodeID | None] | None = None  # the spot-check running beside our steps
        # (id, size) of the decode steps of other sessions our next one is sent with (see client.batching)
        self.batch = NO_BATCH
        self.speculation: Speculation | None = None  # drafts to verify in greedy generation (client.drafting)
        # Where to decode after the prompt (client.split): this route if set, else the plan's decode flows' route
        # if it has them (RouteSource.decode_route); the moves made, for logs, tests and benchmarks
        self.decode_route: Route | None = None
        self.moves: list[Move] = []
        self._move_pending = False  # the prompt is in: move before the first decode step

    def _avoid(self) -> frozenset[NodeID]:
        excluded = self.checker.excluded if self.checker is not None else set()
        return frozenset(self.avoided | excluded)

    async def open(self) -> None:
        self.stages = await self._route_or_wait(0, SOURCE)
        logger.info("session %s route %s", self.session_id[:8], route_text(self.stages))

    @property
    def position(self) -> int:
        return len(self.token_ids)

    async def forward(self, new_ids: Sequence[int], argmax_only: bool = False) -> torch.Tensor:
        """Send `new_ids` through the swarm and return the logits[V] after the last of them (with
        ``argmax_only``, only their argmax is sure to be exact: Head.logits)."""
        out = await self._send(new_ids)
        return self.head.logits(out[-1:], argmax_only)[0]

    async def forward_all(self, new_ids: Sequence[int], argmax_only: bool = False) -> torch.Tensor:
        """Send `new_ids` through the swarm and return logits[T, V], row i after new_ids[i] (a speculative
        step: client.drafting)."""
        out = await self._send(new_ids)
        return self.full_head.logits(out, argmax_only)

    def rewind(self, length: int) -> None:
        """Forget the tokens at positions >= ``length`` (rejected drafts). No message: the next step goes at
        position ``length``, and each peer cuts its cache back to a step's position before running it."""
        if not 0 <= length <= self.position:
            raise ValueError(f"cannot rewind a session of {self.position} tokens to {length}")
        del self.token_ids[length:]

    async def _send(self, new_ids: Sequence[int]) -> torch.Tensor:
        """Send `new_ids` through the route at the session's position, failing over as the policy says:
        the last stage's hidden [T, H]."""
        self._check_forward(new_ids)
        if not self.stages:
            await self.open()
        await self._move_if_pending()
        prompt = not self.token_ids
        for attempt in itertools.count():
            try:
                # after a failover, first refill the caches of the stages that lack the prefix (only those)
                await self._replay()
                out = await self._step(list(new_ids), self.position)
                await self._spot_check([*self.token_ids, *new_ids])
                break
            except Exception as error:
                if await self._follow(error, attempt):
                    continue  # our cache moved with the session: same position, nothing to replay
                await self._recover(error, attempt)
        self._filled = set(self.stages)
        self.routes.succeeded(s.peer_id for s in self.stages)
        self.token_ids.extend(int(t) for t in new_ids)
        self._move_pending = prompt
        return out

    async def _move_if_pending(self) -> None:
        """Once, after the prompt: move to ``decode_route``, or to the plan's decode route if it has one."""
        if not self._move_pending:
            return
        self._move_pending = False
        try:
            route = self.decode_route
            if route is None:
                route = await self.routes.decode_route(self.max_length_tokens, self._avoid())
            if route:
                await self.move(route)
        except (
            SwarmError,
            TimeoutError,
            ConnectionError,
            OSError,
        ) as error:  # a move is never worth a failure
            logger.info("session %s decodes where it prefilled: %r", self.session_id[:8], error)

    async def move(self, decode: Route) -> list[Move]:
        """Move the stages of the session's route that can to peers of ``decode`` (client.split): each stage's
        peer hands its cache to the target (or, a part at a time, to the targets of its parts), stages at once,
        and the session steps there from the same position, with nothing replayed. A stage whose move fails
        stays where it is. Returns this call's moves."""
        if not self.stages or not self.token_ids:
            return []
        wanted = {s.layers for s in self.stages} | {
            part for s in self.stages for d in decode if (part := cut(s, d)) is not None
        }
        holders = {layers: set(await self.routes.holders(layers)) for layers in wanted}
        plans = plan_moves(self.stages, decode, lambda layers, peer: peer in holders[layers])
        done = await asyncio.gather(*(self._move_whole_or_parts(self.stages[i], to) for i, to in plans))
        moves = [m for stage_moves in done for m in stage_moves]
        before = self.stages
        self.stages, replaced = moved_route(before, moves)
        self._filled = {new for old in before if old in self._filled for new in replaced.get(old, (old,))}
        self.moves.extend(moves)
        logger.info(
            "session %s moved %d of %d stages after its prompt: %s",
            self.session_id[:8],
            len(replaced),
            len(plans),
            route_text(self.stages),
        )
        return moves

    async def _move_whole_or_parts(self, stage: Stage, to: Route) -> list[Move]:
        """Move ``stage`` to ``to``: one stage holding all its layers, or its parts one after another (its peer
        keeps the session until the last is in, then we close it there; if one fails, the parts sent are
        closed and the stage stays)."""
        if len(to) == 1 and to[0].layers == stage.layers:
            return [await self._move_stage(stage, to[0].peer_id)]
        moves: list[Move] = []
        try:
            for part in to:
                moves.append(await self._move_stage(stage, part.peer_id, part.layers))
                if moves[-1].error:
                    break
        finally:  # every part asked for, a half-sent one too, or the stage it left
            moved = len(moves) == len(to) and not any(m.error for m in moves)
            gone = [stage] if moved else [Stage(p.peer_id, p.layers) for p in to[: max(1, len(moves))]]
            for left in gone:
                with contextlib.suppress(SwarmError, TimeoutError, ConnectionError, OSError):
                    await self.chain.close(self.session_id, (left,))
        return moves

    async def _move_stage(self, stage: Stage, target: NodeID, part: LayerRange | None = None) -> Move:
        began = time.monotonic()
        try:
            tokens, kv_bytes = await self.chain.move(
                self.session_id, stage, target, self.step_timeout_s, part
            )
        except (SwarmError, TimeoutError, ConnectionError, OSError) as error:
            logger.info(
                "session %s stays on %s: moving to %s failed (%s: %s)",
                self.session_id[:8],
                stage.peer_id[-8:],
                target[-8:],
                type(error).__name__,
                error,
            )
            seconds = time.monotonic() - began
            return Move(stage, target, 0, seconds, f"{type(error).__name__}: {error}", part=part)
        if tokens != self.position:  # not the cache we sent: it stays unfilled, and the next step refills it
            self._filled.discard(stage)
            wrong = f"peer {stage.peer_id} moved {tokens} tokens of a session of {self.position}"
            return Move(stage, target, tokens, time.monotonic() - began, wrong, part=part)
        return Move(stage, target, tokens, time.monotonic() - began, kv_bytes=kv_bytes, part=part)

    def _check_forward(self, new_ids: Sequence[int]) -> None:
        """Raise if `forward(new_ids)` cannot go: the session is closed, or the tokens are none or too many."""
        if self._closed:
            raise SwarmError("the session is closed")
        if not new_ids:
            raise ValueError("forward needs at least one token")
        if self.position + len(new_ids) > self.max_length_tokens:
            raise ValueError(
                f"session would hold {self.position + len(new_ids)} tokens, "
                f"past max_length_tokens={self.max_length_tokens}"
            )

    async def _step(self, ids: list[int], position: int) -> torch.Tensor:
        hidden = self.head.embed(torch.tensor(ids, dtype=torch.long))
        relayed, self._relay_once = self._relay_once, False
        batch, self.batch = self.batch, NO_BATCH
        if len(ids) == 1 and not relayed and batch != NO_BATCH:
            step = self.chain.step(
                self.session_id, self.stages, position, hidden, self.max_length_tokens, batch=batch
            )
        else:
            step = self._pipelined(self.stages, hidden, position, relayed)
        out = await self.watch.run(step, self.stages, len(ids), self.step_timeout_s)
        if out.dim() != 2 or out.shape[0] != len(ids):
            raise SwarmError(f"the route returned hidden of shape {list(out.shape)} for {len(ids)} tokens")
        return out

    async def _pipelined(
        self, stages: Route, hidden: torch.Tensor, position: int, relayed: bool = False
    ) -> torch.Tensor:
        """Send ``hidden`` [T, H] at ``position`` through ``stages``, a long prompt as consecutive chunks sent
        at once (HPipe): peer k computes chunk i while peer k+1 computes chunk i-1, so the route's peers work
        on one prompt together instead of each waiting for the whole of it. Peers run a session's steps in
        position order whatever order they arrive in (swarm/peer/executor.py). ``relayed``: the output comes
        back along the route instead of to a wait at the last hop."""

        async def send(start: int, size: int) -> torch.Tensor:
            part = hidden[start : start + size]
            return await self.chain.step(
                self.session_id, stages, position + start, part, self.max_length_tokens, **_relayed(relayed)
            )

        return torch.cat(await chunked(hidden.shape[0], position, self.prefill_chunk_tokens, send))

    async def _replay(self) -> None:
        """Refill the caches of the route's stages that lack the session's tokens, and only theirs.

        The client never sees the hidden states between two stages, so it asks the kept stage before the first
        one to fill to resend what it sent on the first time (its log, swarm/peer/outputs.py), through the
        stages from that one to the last one to fill, and discards their output; where the first stage is to
        fill, or the kept one has no log (it restarted, or the session moved to it), the client sends the
        embeddings itself from stage 0. Stages after the last one to fill keep their caches: the next step
        reaches them from a new hop, at the session's position, and they take it (their sessions are keyed by
        the client). Greedy output stays exact: each stage computes from the very inputs of the first pass."""
        missing = [i for i, stage in enumerate(self.stages) if stage not in self._filled]
        tokens = len(self.token_ids)
        if not missing or not tokens:
            self._filled = set(self.stages)
            return
        first, last = missing[0], missing[-1]
        resent_by = self.stages[first - 1].peer_id if first > 0 else None
        if resent_by is not None:
            try:
                await self._resend(self.stages[first - 1 : last + 1], tokens)
            except SessionError as error:  # no log there: replay from the tokens, as before partial replay
                if getattr(error, "failed_peer_id", None) not in (None, "", resent_by):
                    raise  # a stage to fill failed: the failover handles it like any other
                logger.info("session %s: no resend from %s (%s)", self.session_id[:8], resent_by[-8:], error)
                first, resent_by = 0, None
        replayed = self.stages[first : last + 1]
        if resent_by is None:
            hidden = self.head.embed(torch.tensor(self.token_ids, dtype=torch.long))
            step = self._pipelined(replayed, hidden, 0)
            await self.watch.run(step, replayed, tokens, self.step_timeout_s)
        self.replayed_tokens += tokens * len(replayed)
        self.replays.append(Replay(replayed, tokens, resent_by))
        self._filled.update(replayed)
        logger.info(
            "session %s replayed %d tokens through %s (%s)",
            self.session_id[:8],
            tokens,
            route_text(replayed),
            f"resent by {resent_by[-8:]}" if resent_by is not None else "from the client",
        )

    async def _resend(self, stages: Route, tokens: int) -> None:
        """``stages[0]`` resends its outputs [0, tokens) through ``stages[1:]`` (chunked like a prompt)."""
        hidden_size = self.head.hidden_size

        async def send(start: int, size: int) -> None:
            await self.chain.resend(self.session_id, stages, start, size, hidden_size, self.max_length_tokens)

        await self.watch.run(
            chunked(tokens, 0, self.prefill_chunk_tokens, send), stages, tokens, self.step_timeout_s
        )

    async def _spot_check(self, token_ids: list[int]) -> None:
        """WrongOutput if a peer of the route was found lying (by any check of this client); on a sampled step,
        start a check (or, with ``checker.blocking``, run it now).

        The step's output is then not used: the failover replays it on a route without that peer. A check that
        runs beside the next steps costs the user's stream nothing but the peers' time; a liar it finds is
        caught at the step after it ends, so the tokens in between came through it, as the tokens of every
        step that was not checked did."""
        if self.checker is None:
            return
        self.checker.steps_served.update(s.peer_id for s in self.stages)
        # a check of another session may have caught a peer of our route since it was built
        liar = next((s.peer_id for s in self.stages if s.peer_id in self.checker.excluded), None)
        if liar is None and self.checker.blocking and self.checker.due():
            liar = await self.checker.check(self.stages, token_ids)
        elif liar is None and (self._check is None or self._check.done()) and self.checker.due():
            self._check = self.checker.start(self.stages, token_ids)  # one at a time per session
        if liar is not None and liar in {s.peer_id for s in self.stages}:
            error = WrongOutput(f"peer {liar} computed wrong outputs (spot-check)")
            error.failed_peer_id = liar
            raise error

    async def _recover(self, error: Exception, attempt: int) -> None:
        """Act on the policy's decision about `error`: re-raise it, or fix the route for a replay."""
        decision = self.policy.decide(error, attempt, self.stages[0].peer_id)
        if decision.action is Action.GIVE_UP:
            raise error
        failed, action, detected_by = await self._blame(decision)
        logger.warning(
            "session %s step failed at peer %s (%s: %s); %s, try %d",
            self.session_id[:8],
            failed[-8:],
            type(error).__name__,
            error,
            action.value,
            attempt + 1,
        )
        self.failover_log.append(
            Failover(type(error).__name__, failed, action, detected_by, time.monotonic())
        )
        if action is Action.WITHDRAW:
            self.routes.withdraw(failed)
            self.routes.ban(failed)
        elif action is Action.BAN_AND_REROUTE:
            self.routes.ban(failed)
        elif action is Action.REROUTE:
            self.avoided.add(failed)
        self._distrust(error, failed, action, attempt)
        self._relay_once = True
        await self._reroute(failed)
        # the pause gives the DHT time to notice a failure; one we saw die first hand is out of routing already
        await self.sleep(0.0 if action is Action.WITHDRAW else decision.delay_s)
        self.failovers += 1

    def _distrust(self, error: Exception, failed: NodeID, action: Action, attempt: int) -> None:
        """Forget that stages hold the session's tokens where the failure says they may not (beyond the failed
        one and those the new route drops, which ``_reroute`` forgets)."""
        if isinstance(error, WrongOutput):
            # the stages after a liar computed from its outputs: fill them again
            liar = next((i for i, s in enumerate(self.stages) if s.peer_id == failed), 0)
            self._filled.difference_update(self.stages[liar:])
        elif action is Action.REPLAY and attempt > 0:
            # a hop lost our session again after a partial replay: the error may name the wrong hop (a hop's
            # claim about the next one), so refill every stage, as a full replay from the tokens does
            self._filled.clear()

    async def _follow(self, error: Exception, attempt: int) -> bool:
        """SessionMoved: put the named successor in the failed peer's stage; False (and the error is then a plain
        SessionError: replay) unless it is a live holder of that stage's layers and not on the route already.
        The successor's name comes from a peer of the route, so it is only trusted as far as the DHT agrees."""
        decision = self.policy.decide(error, attempt, self.stages[0].peer_id)
        if decision.action is not Action.FOLLOW or decision.successor is None:
            return False
        index = next((i for i, s in enumerate(self.stages) if s.peer_id == decision.failed_peer), None)
        stage = self.stages[index] if index is not None else None
        if (
            index is None
            or stage is None
            or decision.successor in {s.peer_id for s in self.stages}
            or decision.successor not in await self.routes.holders(stage.layers)
        ):
            logger.info(
                "session %s: not following the hand-over to %s", self.session_id[:8], decision.successor
            )
            error.successor_id = None  # type: ignore[attr-defined]  # a plain SessionError from here: replay
            return False
        self.stages = (
            *self.stages[:index],
            Stage(decision.successor, stage.layers),
            *self.stages[index + 1 :],
        )
        logger.info("session %s followed its hand-over: %s", self.session_id[:8], route_text(self.stages))
        self.failover_log.append(
            Failover(type(error).__name__, stage.peer_id, Action.FOLLOW, "error", time.monotonic())
        )
        self.failovers += 1
        self._relay_once = True
        if stage in self._filled:  # the successor holds the prefix: the cache moved with the session
            self._filled.add(self.stages[index])
        return True

    async def _blame(self, decision: Decision) -> tuple[NodeID, Action, str]:
        """Whom to act against, how, and how we know ("asked" or "error"). Only the first hop's failures reach
        us first hand; a later hop's failure is a claim (``failed_peer_id``) made by the hops in between, and
        any hop could name an honest peer to get it banned, so no ban rests on a claim alone:

        - "it is silent" (transport errors): every hop is asked directly, with a short deadline; a hop that
          does not answer is withdrawn (it is dead to us); if all answer, the hop before the named one, which
          claims it failed, is banned instead;
        - "it sent garbage" (protocol errors): nothing we can ask proves or disproves it, so the named peer is
          only routed around for this session, and nobody is banned."""
        timeout_s = min(self.watch.config.probe_timeout_s, self.step_timeout_s)
        named = decision.failed_peer or self.stages[0].peer_id
        if decision.action is Action.WITHDRAW:  # PeerSilent: our own probe found it silent, first hand
            return named, decision.action, "probe"
        if decision.find_silent:
            silent = await self.chain.find_silent(self.stages, timeout_s)
            if silent is not None:
                return silent, Action.WITHDRAW, "asked"
        index = next((i for i, s in enumerate(self.stages) if s.peer_id == named), None)
        if decision.action is not Action.BAN_AND_REROUTE or index == 0:
            return named, decision.action, "error"  # first hand, or no ban follows
        # a peer that is not on our route cannot have failed it: the first hop relayed a lie
        if index is None:
            return self.stages[0].peer_id, decision.action, "error"
        if not decision.find_silent:
            return named, Action.REROUTE, "error"
        # find_silent asked every hop, the named one included, and all of them answered
        claimant = self.stages[index - 1].peer_id
        logger.warning(
            "peer %s says %s failed, but it answers: blaming %s", claimant[-8:], named[-8:], claimant[-8:]
        )
        return claimant, decision.action, "asked"

    async def _reroute(self, failed: NodeID) -> None:
        """Replace the stages from `failed`'s stage on; the stages before it are kept."""
        index = next((i for i, s in enumerate(self.stages) if s.peer_id == failed), 0)
        kept = self.stages[:index]
        start, prev = (kept[-1].layers.end, kept[-1].peer_id) if kept else (0, SOURCE)
        tail = await self._route_or_wait(start, prev)
        joined = join_route(kept, tail)
        if joined is None:  # the tail runs through a kept peer again: route afresh from layer 0
            joined = await self._route_or_wait(0, SOURCE)
        on_route = {s.peer_id for s in joined}
        dropped = [s for s in self.stages if s.peer_id != failed and s.peer_id not in on_route]
        self.stages = joined
        # a stage keeps its cache if it was on the route (same peer, same layers) and did not fail
        self._filled = {s for s in self.stages if s in self._filled and s.peer_id != failed}
        logger.info("session %s re-routed: %s", self.session_id[:8], route_text(self.stages))
        # Peers that left the route still hold our cache: ask them to drop it, one by one since the chain
        # through them is broken. Best effort: an unreachable peer frees it when the session expires.
        for stage in dropped:
            await self._close_quietly([stage])

    async def _route_or_wait(self, start: int, prev: NodeID) -> Route:
        """A route from layer `start` after `prev`. While no live peer serves some layers, wait for one (a
        holder restarting or moving, a late join), re-reading the swarm every `route_poll_s`, for up to
        `route_wait_s`; then NoRouteError names the layers. Peers this session avoided (full, leaving, said
        to send garbage) are only deprioritised: they are tried again when nobody else holds their layers."""
        deadline = time.monotonic() + self.policy.route_wait_s
        logged_at = -float("inf")
        while True:
            try:
                return await self.routes.route(
                    start, prev, self.max_length_tokens, self._avoid(), self.session_id
                )
            except NoRouteError as error:
                if self.avoided:
                    logger.info(
                        "session %s: only avoided peers hold some layers; trying them again",
                        self.session_id[:8],
                    )
                    self.avoided.clear()
                    continue
                left_s = deadline - time.monotonic()
                if left_s <= 0:
                    raise
                self.route_waits += 1
                if time.monotonic() - logged_at >= ROUTE_WAIT_LOG_S:  # progress, not a line per poll
                    logged_at = time.monotonic()
                    logger.warning(
                        "session %s waiting for a route: %s (%.0f s left)", self.session_id[:8], error, left_s
                    )
                await self.sleep(min(self.policy.route_poll_s, left_s))

    async def close(self) -> None:
        """Free the session's KV cache on every peer of the route. Never raises for a peer that is gone."""
        if self._closed:
            return
        self._closed = True
        self.routes.release(self.session_id)
        if self.stages:  # even before any step came back: the first one may be on its way or running
            await self._close_quietly(self.stages)

    async def _close_quietly(self, stages: Sequence[Stage]) -> None:
        try:
            await self.chain.close(self.session_id, stages)
        except (SwarmError, TimeoutError, ConnectionError, OSError) as error:
            logger.info("closing session %s: %s", self.session_id[:8], error)


def join_route(kept: Route, tail: Route) -> Route | None:
    """``kept`` then ``tail`` as one route, or None if that cannot be a route.

    The router builds the tail without knowing the kept stages, so it may start on the last kept peer, which
    holds layers past its stage: that is one stage of both (its new layers hold nothing of the session yet, so
    the replay refills the whole stage). A tail naming an earlier kept peer again is no route at all: a peer
    refuses a route that names it twice."""
    if kept and tail and tail[0].peer_id == kept[-1].peer_id:
        merged = Stage(tail[0].peer_id, LayerRange(kept[-1].layers.start, tail[0].layers.end))
        kept, tail = kept[:-1], (merged, *tail[1:])
    if {s.peer_id for s in kept} & {s.peer_id for s in tail}:
        return None
    return (*kept, *tail)


def _relayed(relayed: bool) -> dict[str, Any]:
    """The ``relayed`` argument of Chain.step, only when set (a chain that never relays need not take it)."""
    return {"relayed": True} if relayed else {}
