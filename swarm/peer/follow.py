"""Following the published plan: move this peer to the layers the elected planner gave it, with no coverage gap.

Decide (pure functions of a snapshot), then act (PlanFollower). A move from the held range O to the planned
range N goes:

  1. T = the hull of O and N when it fits in max_layers or in |O| + |N| layers (else T = N); load T's blocks on a thread while we
     keep serving O. Nothing is dropped yet, and when T covers O nothing is dropped at all in this step.
  2. Layers we are about to stop serving (O - T) are dropped only once the snapshot shows each of them served
     by another peer that keeps it: one the plan gives that layer, or one the plan does not move. A peer that
     is itself leaving the layer does not count, or two movers could each count on the other and both leave.
  3. Switch to T (announce it at once), then, the same way, wait until T - N is kept by others and narrow T
     to N, reusing the loaded modules (no second load).

Blocks are assembled from the modules already held plus only the layers missing, so the hull path holds at
most max(max_layers, |O| + |N|) layers; the direct path (hull too big) holds O and N - O at once for the handover.

Every planned layer is served by its planned peer as soon as that peer finishes step 1, which waits on no one,
so the waits in step 2 always end unless two peers swap ranges far apart (the hull exceeds both bounds). For that
case a wait gives up after handover_timeout_s and drops the layers anyway (logged as a warning).

Make before break: once the next range is loaded the peer serves it (new sessions open there; the record
announces it as the held range and the old one under older_ranges). When the new range contains the old one
(step 1 always, and a plain grow), the old range's sessions carry over to it (same keys, same KV cache, their
steps on the old layers keep working) and the old range is gone at once (Peer.carry_over). Otherwise the old
range keeps serving the sessions it opened, in the background so the follower can take the next plan, and is
dropped as soon as they have ended or moved away (closed by their client after a re-route, handed over, or
reaped when idle or past their lifetime); session_grace_s is only a safety bound on that wait. Sessions still
open then are dropped and their next step raises SessionError, so the client re-routes and replays.

Memory: the modules of the layers both ranges hold are shared, never loaded twice. A move holds at most
move_budget() layers at once: max_move_layers, or by default max(max_layers, |O| + |N|) (see transition_range),
plus the KV cache of the sessions still open on the old range, which grows only with the tokens they use. When
neither the hull nor the direct path fits (resident_layers > budget), the move goes in steps (_move_in_steps):
wait for others to keep O - N, narrow to O & N (no load), drop O once its sessions end, then load N - O and
carry the narrowed range's sessions over. The peer then serves only O & N (nothing, if disjoint) while it loads,
and a wait for O's sessions holds up the next plan epoch. A strict max_move_layers can also bring back the
swap wait above (both peers take this path), which handover_timeout_s bounds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from torch import nn

from swarm.dht import Directory, SwarmSnapshot
from swarm.dht.watch import SwarmWatch
from swarm.models.blocks import BlockRange
from swarm.models.heap import freeze_loaded
from swarm.models.loading import ModelSource
from swarm.peer.config import FollowConfig
from swarm.peer.measure import packing_bytes
from swarm.peer.state import Peer, Served, Status
from swarm.types import LayerRange, NodeID, Plan

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------- decisions


def plan_of(snapshot: SwarmSnapshot) -> Plan | None:
    """The snapshot's plan, parsed (None when there is none). The Directory hands out only the lease
    holder's plan, validated and checked against the snapshot's peers (swarm.dht.trust), so this is the
    one plan the whole swarm follows; a plan from anyone else never reaches here."""
    if snapshot.plan is None:
        return None
    try:
        return snapshot.plan.to_plan()
    except ValueError as e:  # the record validated its body: only a bug gets here
        logger.warning("ignoring malformed plan epoch %d: %s", snapshot.plan.epoch, e)
        return None


def planned_range(
    peer_id: str, held: LayerRange, snapshot: SwarmSnapshot, adopted_epoch: int, num_layers: int
) -> LayerRange | None:
    """The range to move to: the plan's range for this peer, if the plan is newer than `adopted_epoch` and
    gives us a valid range other than `held`; else None (nothing to do)."""
    plan = plan_of(snapshot)
    if plan is None or snapshot.plan is None or snapshot.plan.epoch <= adopted_epoch:
        return None
    target = plan.placement.get(NodeID(peer_id))
    if target is None or target == held or target.end > num_layers:
        return None
    return target


def transition_range(held: LayerRange, target: LayerRange, max_layers: int) -> LayerRange:
    """What to serve while moving: the hull of both ranges, else the target.

    The hull is taken when it fits in memory, and also when it holds no more layers than the old and new
    ranges together, which the direct path holds anyway during its handover. The second case matters: two
    peers swapping overlapping ranges (0:13 -> 11:24 and 13:26 -> 0:11 with 13 layers each) would otherwise
    both take the direct path, each waiting for the other to announce its new range before announcing its
    own, until handover_timeout_s. With the hull, one of them announces at once and the other can follow.
    """
    hull = LayerRange(min(held.start, target.start), max(held.end, target.end))
    return hull if len(hull) <= max(max_layers, len(held) + len(target)) else target


def resident_layers(held: LayerRange, target: LayerRange, transit: LayerRange) -> int:
    """Layers held at once by a move through ``transit``: the hull alone (it contains the old range), or the
    old range and the target's other layers during the direct path's handover (shared modules count once)."""
    if transit.covers(held):
        return len(transit)
    shared = held.intersect(target)
    return len(held) + len(target) - (len(shared) if shared is not None else 0)


def move_budget(held: LayerRange, target: LayerRange, max_layers: int, max_move_layers: int) -> int:
    """The most layers a move may hold at once: ``max_move_layers``, or by default what transition_range
    allows (max_layers, or the old and new ranges together); never less than either range."""
    limit = max_move_layers or max(max_layers, len(held) + len(target))
    return max(limit, len(held), len(target))


def dropped_layers(before: LayerRange, after: LayerRange) -> list[int]:
    return [layer for layer in range(before.start, before.end) if layer not in after]


def unkept_layers(peer_id: str, layers: list[int], snapshot: SwarmSnapshot) -> list[int]:
    """The `layers` that no other serving peer both serves now and keeps under the snapshot's plan."""
    plan = plan_of(snapshot)
    placement = plan.placement if plan is not None else {}
    missing = []
    for layer in layers:
        kept = False
        for pid, record in snapshot.serving().items():
            if pid == peer_id or not record.range_start <= layer < record.range_end:
                continue
            planned = placement.get(NodeID(pid))
            if planned is None or layer in planned:  # unplanned peers do not move until the next epoch
                kept = True
                break
        if not kept:
            missing.append(layer)
    return missing


# ---------------------------------------------------------------------------------------------- actions


def assemble_blocks(
    source: ModelSource, held: BlockRange, layers: LayerRange, pack_bytes: int = 0
) -> BlockRange:
    """A BlockRange of `layers` with a fresh KV cache, reusing `held`'s modules for the layers it has and
    loading only the others (run it off the event loop). The modules are read-only at inference and already
    in the form their backend holds them, so the old and the new BlockRange share them while the old one still
    serves, and the new one runs as a range loaded at join (``pack_bytes`` as there: see spare_bytes)."""
    layers.check_within(source.spec.num_layers)
    device, dtype = str(held.device), str(held.dtype).removeprefix("torch.")
    modules: list[nn.Module] = []
    layer = layers.start
    while layer < layers.end:
        if layer in held.range:
            modules.append(held.layers[layer - held.range.start])
            layer += 1
            continue
        # A run of layers we do not hold: load it in one go.
        end = held.range.start if layer < held.range.start else layers.end
        end = min(end, layers.end)
        loaded = source.load_blocks(layer, end, device, dtype, cache_tokens=0, quant=held.quant)
        modules.extend(loaded.layers)
        layer = end
    return BlockRange(
        source.spec,
        source.config,
        modules,
        layers,
        held.cache.cache_tokens,
        held.device,
        held.dtype,
        pack_bytes,
        held.quant,
    )


def spare_bytes(source: ModelSource, held: BlockRange, memory_bytes: int, layers: LayerRange) -> int:
    """BlockRange's ``pack_bytes`` for ``layers`` within a budget of ``memory_bytes``, counted as at join."""
    device, dtype = str(held.device), str(held.dtype).removeprefix("torch.")
    weight_bytes = source.held_layer_bytes(device, dtype, held.quant)
    cache_tokens = held.cache.cache_tokens
    return packing_bytes(source.spec, dtype, memory_bytes, cache_tokens, len(layers), weight_bytes)


class PlanFollower:
    """Moves the peer's served range to the plan's, one epoch at a time, without leaving layers unserved.

    `announce` stores the peer's current record in the DHT.
    """

    def __init__(
        self,
        *,
        peer: Peer,
        directory: Directory,
        source: ModelSource,
        announce: Callable[[], Awaitable[object]],
        config: FollowConfig | None = None,
        hand_over: Callable[[Served], Awaitable[object]] | None = None,
        watch: SwarmWatch | None = None,
    ) -> None:
        """``hand_over`` moves the sessions still open on a range about to be dropped (swarm.peer.handover).
        With ``watch``, plans are looked for in its snapshots, as soon as one is read (swarm.dht.watch), not
        in a snapshot of our own every check interval."""
        self.peer = peer
        self.hand_over = hand_over
        self.directory = directory
        self.source = source
        self.announce = announce
        self.config = config or FollowConfig()
        self.watch = watch
        self.adopted_epoch = 0
        self.moves = 0  # completed moves (for tests and status)
        self._retiring: set[asyncio.Task[None]] = set()  # old ranges waiting for their sessions to end

    @property
    def held(self) -> LayerRange:
        held = self.peer.held
        if held is None:
            raise RuntimeError("the plan follower runs only while the peer serves a range")
        return held

    async def run(self) -> None:
        try:
            while True:
                seen = self.watch.version if self.watch is not None else 0
                try:
                    await self.check()
                except (
                    Exception
                ) as e:  # one bad round (DHT timeout, queue full, a bug) must not stop following
                    logger.warning(
                        "plan check failed (retrying in %.1f s): %r", self.config.check_interval_s, e
                    )
                if self.watch is not None:
                    await self.watch.wait_newer(seen, self.config.check_interval_s)
                else:
                    await asyncio.sleep(self.config.check_interval_s)
        finally:
            for task in self._retiring:  # shutting down: the peer's drain closes what is still open
                task.cancel()
            await asyncio.gather(*self._retiring, return_exceptions=True)

    async def retired(self) -> None:
        """Wait until every old range has been dropped (tests; the drop itself needs no waiter)."""
        while self._retiring:
            await asyncio.gather(*self._retiring, return_exceptions=True)

    async def check(self) -> None:
        """One look at the plan: move if it is newer than the adopted one and gives us other layers."""
        if self.peer.status not in (Status.SERVING, Status.MOVING):
            return  # leaving the swarm (or not serving yet): no moves
        snapshot = await (self.watch.latest() if self.watch is not None else self.directory.snapshot())
        if snapshot.plan is None or snapshot.plan.epoch <= self.adopted_epoch:
            return
        epoch = snapshot.plan.epoch
        max_layers = self.peer.identity.max_layers
        target = planned_range(
            self.peer.peer_id, self.held, snapshot, self.adopted_epoch, self.source.spec.num_layers
        )
        if target is not None and len(target) > max_layers:
            logger.warning(
                "plan epoch %d gives us %s, more than the %d layers we fit", epoch, target, max_layers
            )
            target = None
        if target is not None:
            self.peer.set_moving(True)
            try:
                if not await self.move(target, epoch):
                    return  # a newer plan came during the move: the next check follows that one
            finally:
                self.peer.set_moving(False)
        self.adopted_epoch = epoch
        logger.info("plan epoch %d adopted: serving layers %s", epoch, self.held)

    async def move(self, target: LayerRange, epoch: int) -> bool:
        """Serve `target` instead of the held range; False if abandoned because the plan changed."""
        began = time.monotonic()
        old, max_layers = self.held, self.peer.identity.max_layers
        budget = move_budget(old, target, max_layers, self.config.max_move_layers)
        transit = transition_range(old, target, max_layers)
        if resident_layers(old, target, transit) > budget:
            transit = target  # the hull does not fit: straight to the target
        if resident_layers(old, target, transit) > budget:
            logger.info(
                "plan epoch %d: moving %s -> %s in steps (%d layers at most)", epoch, old, target, budget
            )
            return await self._move_in_steps(target, epoch)
        logger.info("plan epoch %d: moving %s -> %s (via %s)", epoch, old, target, transit)
        if transit != old:
            current = self._current_blocks()
            spare = spare_bytes(self.source, current, self.peer.identity.memory_bytes, transit)
            blocks = await asyncio.to_thread(assemble_blocks, self.source, current, transit, spare)
            if transit.covers(old):  # nothing dropped: the open sessions come along
                await self.peer.carry_over(blocks)
                await self._announce(transit)
            else:
                if not await self._handover(dropped_layers(old, transit), epoch):
                    return False
                await self._switch(blocks)
        if transit != target:
            if not await self._handover(dropped_layers(transit, target), epoch):
                return False
            current = self._current_blocks()
            spare = spare_bytes(self.source, current, self.peer.identity.memory_bytes, target)
            await self._switch(assemble_blocks(self.source, current, target, spare))  # no load: inside
        self.moves += 1
        logger.info("plan epoch %d: serving %s after %.1f s", epoch, target, time.monotonic() - began)
        return True

    async def _move_in_steps(self, target: LayerRange, epoch: int) -> bool:
        """A move whose old and new layers do not fit at once: once others keep the layers we give up, narrow
        to the layers both ranges share (no load), drop the old range when its sessions end (the safety bound
        applies), then load only the missing layers and carry the kept range's sessions over. Never holds more
        layers than the larger of the two ranges (plus the old range's sessions' KV until they end); this peer
        serves only the shared layers (none, for disjoint ranges) while it loads the others."""
        old = self.peer.current
        if old is None:
            raise RuntimeError("no range is being served")
        if not await self._handover(dropped_layers(old.range, target), epoch):
            return False
        device, dtype = str(old.blocks.device), str(old.blocks.dtype).removeprefix("torch.")
        cache_tokens, quant = old.blocks.cache.cache_tokens, old.blocks.quant
        spare = spare_bytes(self.source, old.blocks, self.peer.identity.memory_bytes, target)
        keep = old.range.intersect(target)
        if keep is not None:
            keep_spare = spare_bytes(self.source, old.blocks, self.peer.identity.memory_bytes, keep)
            narrowed = assemble_blocks(self.source, old.blocks, keep, keep_spare)  # shares old's modules
            self.peer.serve(narrowed)
            await self._announce(keep)
        else:
            old.accepting = False  # nothing to serve meanwhile: no new sessions on layers being given up
            self.peer.changed.set()
        await self._retire(old)  # old's other layers are freed once nothing refers to them
        del old
        kept = self.peer.current
        if kept is not None:
            blocks = await asyncio.to_thread(assemble_blocks, self.source, kept.blocks, target, spare)
            await self.peer.carry_over(blocks)
        else:
            fresh = await asyncio.to_thread(
                self.source.load_blocks,
                target.start,
                target.end,
                device,
                dtype,
                cache_tokens,
                spare,
                quant,
            )
            self.peer.serve(fresh)
        await self._announce(target)
        freeze_loaded()  # the new layers' objects, as at start (swarm.models.heap)
        self.moves += 1
        return True

    def _current_blocks(self) -> BlockRange:
        current = self.peer.current
        if current is None:
            raise RuntimeError("no range is being served")
        return current.blocks

    async def _handover(self, layers: list[int], epoch: int) -> bool:
        """Wait until others keep `layers`; False if a newer plan appeared meanwhile."""
        deadline = time.monotonic() + self.config.handover_timeout_s
        missing = layers
        while missing:
            try:
                snapshot = await self.directory.snapshot()
            except (TimeoutError, OSError, RuntimeError) as e:
                logger.warning("handover check failed: %r", e)
            else:
                if snapshot.plan is not None and snapshot.plan.epoch > epoch:
                    logger.info("plan epoch %d replaced epoch %d during our move", snapshot.plan.epoch, epoch)
                    return False
                missing = unkept_layers(self.peer.peer_id, layers, snapshot)
                if not missing:
                    break
            if time.monotonic() > deadline:
                logger.warning(
                    "dropping layers %s though no other peer keeps them (waited %.0f s)",
                    missing,
                    self.config.handover_timeout_s,
                )
                break
            await asyncio.sleep(self.config.check_interval_s)
        return True

    async def _switch(self, blocks: BlockRange) -> None:
        """Serve `blocks` from now on and announce it (make before break): new sessions open on `blocks`; the
        old range serves its open sessions until they end (see _retire), without holding up the next move."""
        old = self.peer.current
        self.peer.serve(blocks)
        await self._announce(blocks.range)
        if old is not None:
            task = asyncio.create_task(self._retire(old), name=f"retire {old.range}")
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)

    async def _announce(self, layers: LayerRange) -> None:
        try:
            async with asyncio.timeout(10):
                await self.announce()
        except (TimeoutError, OSError, RuntimeError) as e:
            logger.warning("could not announce our new range %s at once (%r); the announcer will", layers, e)

    async def _retire(self, old: Served) -> None:
        """Drop `old` once its sessions have ended or moved away (each close wakes the wait), at the latest
        after the safety bound; the sessions still open then are closed (their clients replay elsewhere)."""
        bound_s = min(self.config.session_grace_s, self.peer.config.max_session_lifetime_s)
        if not await self.peer.wait_sessions_ended(old, bound_s):
            logger.warning(
                "layers %s: %d sessions still open after %.0f s: handing them over, else closing them",
                old.range,
                len(old.sessions),
                bound_s,
            )
            if old.sessions and self.hand_over is not None:
                try:
                    await self.hand_over(old)  # to peers holding the same layers: their clients follow
                except Exception as e:  # the sessions left are closed below: their clients replay
                    logger.info("could not hand sessions over before dropping %s: %r", old.range, e)
        await self.peer.drop(old)
        logger.info("dropped layers %s", old.range)
