"""How sessions survive churn in the simulation: partial replay, KV hand-over (issue 13, items 2 and 4).

* Partial replay (SimConfig.partial_replay): when a stage's node is lost, only that stage is replaced. The
  rest of the route is asked of the same Router the client uses (route_from, after the previous stage), and
  the new stages are spliced back into the old route at the first stage boundary where a later old stage
  still holds the session: those stages and the ones before the lost node keep their caches. The client kept
  each stage's inputs, so it sends them (hidden states, or token ids for stage 0) straight to the first new
  stage; the replacement stages re-prefill the session's current length, and the output of the last one
  goes back to the client (the next stage already has it). Then the pending decode step re-enters at the
  first replaced stage. A session with no route waits (its other stages keep their caches) and tries again
  when the swarm or the plan changes: it is never restarted from the prompt.
* KV hand-over (SimConfig.kv_handover): a node that leaves gracefully, or must drop a range, streams each
  open session's KV cache (2 * layers * kv_heads * head_dim * dtype bytes * tokens) to a successor that
  holds the same layers, chosen as the router would route the session past the previous stage (where the
  router's route splits the stage over two nodes, each gets its layers' part). The stream queues on the link
  like any message (bytes / bandwidth, then latency); the session pauses meanwhile and resumes at the same
  position, with no replay. Without a successor it fails over by partial replay.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from swarm.errors import NoRouteError
from swarm.sim.links import send
from swarm.sim.records import SRC
from swarm.types import SOURCE, LayerRange

if TYPE_CHECKING:
    from swarm.sim.engine import Simulation


def stage_layers(sim: Simulation, r: int, k: int) -> LayerRange:
    """The layers stage k of request r's route runs."""
    starts = sim.stage_starts[r]
    end = starts[k + 1] if k + 1 < len(starts) else sim.cluster.model.num_layers
    return LayerRange(starts[k], end)


def kv_bytes(sim: Simulation, layers: int, tokens: int) -> int:
    """KV cache of `tokens` tokens over `layers` layers: K and V, kv_heads * head_dim values each."""
    return int(2 * layers * sim.act_bytes * sim.config.kv_heads_fraction * tokens)


def session_length(sim: Simulation, r: int) -> int:
    return sim.trace[r].prompt_tokens + sim.generated[r]


def _release_on(sim: Simulation, r: int, nodes: list[int]) -> None:
    need = sim.session_tokens(r)
    for i in nodes:
        node = sim.nodes[i]
        if r in node.sessions:
            node.sessions.discard(r)
            node.draining.discard(r)
            node.cache_used -= need
            if node.alive:
                sim._announce(node)
    sim.admission_blocked = False


def _reserve_on(sim: Simulation, r: int, nodes: list[int]) -> None:
    need = sim.session_tokens(r)
    for i in nodes:
        node = sim.nodes[i]
        if r not in node.sessions:
            node.sessions.add(r)
            node.cache_used += need
            sim._announce(node)


def fail_over_partial(sim: Simulation, r: int, lost: int) -> None:
    """Node `lost` no longer serves session r: replace its stage only, and replay through the replacement."""
    sim.failovers += 1
    sim.epoch[r] += 1  # tokens of r in flight anywhere are now stale
    _release_on(sim, r, [lost])
    replace_stage(sim, r, list(sim.routes[r]).index(lost))


def resume_stalled(sim: Simulation, r: int, k: int) -> None:
    if sim.done_s[r] < 0 and k < len(sim.routes[r]) and r not in sim.nodes[sim.routes[r][k]].sessions:
        replace_stage(sim, r, k)


def replace_stage(sim: Simulation, r: int, k: int) -> None:
    """Route stage k of r anew, splice the new stages in, and replay the session through them."""
    nodes, starts = list(sim.routes[r]), list(sim.stage_starts[r])
    prev = sim.ids[nodes[k - 1]] if k > 0 else SOURCE
    try:
        tail = sim.router.route_from(sim.view, starts[k], prev, sim.session_tokens(r))
    except NoRouteError:
        sim.stalled.append((r, k))
        return
    tail_nodes = [sim.index[s.peer_id] for s in tail]
    tail_starts = [s.layers.start for s in tail]
    prefilling = sim.generated[r] == 0
    rejoin = None
    if not prefilling:  # rejoin the old route where a later stage still holds the session
        later = {starts[m]: m for m in range(k + 1, len(nodes)) if r in sim.nodes[nodes[m]].sessions}
        for t, stage in enumerate(tail):
            if stage.layers.end in later:
                rejoin = (t + 1, later[stage.layers.end])
                break
    if rejoin is None:
        new_nodes, new_starts, dropped = nodes[:k] + tail_nodes, starts[:k] + tail_starts, nodes[k + 1 :]
        end = len(new_nodes)
    else:
        t, m = rejoin
        new_nodes = nodes[:k] + tail_nodes[:t] + nodes[m:]
        new_starts = starts[:k] + tail_starts[:t] + starts[m:]
        dropped, end = nodes[k + 1 : m], k + t
    _release_on(sim, r, dropped)
    _reserve_on(sim, r, new_nodes[k:end])
    # A prompt still on its way through stages before k has not reached them: its prefill goes on from there.
    first = min(k, sim.stage[r]) if prefilling else k
    sim.routes[r], sim.stage_starts[r] = tuple(new_nodes), tuple(new_starts)
    sim.stage[r], sim.replay_end[r] = first, end
    sim.resume_stage[r] = 0 if prefilling else first
    sim.replaying[r] = True
    tokens = session_length(sim, r)
    sim.replayed_tokens += tokens * (end - first)
    per_token = sim.token_bytes if first == 0 else sim.act_bytes
    key = r << 8 | (sim.epoch[r] & 255)
    send(sim, SRC, new_nodes[first], tokens * per_token, [(key, tokens)], True)


def successors(sim: Simulation, r: int, k: int, leaving: int) -> list[tuple[int, LayerRange]] | None:
    """Who takes stage k of r, and which of its layers each: the stages the router would route the session
    through after the previous stage, cut at the end of stage k (KV is per layer, so it splits). Usually one
    node holding the same layers. None when no route avoids the leaving node."""
    nodes = sim.routes[r]
    need = stage_layers(sim, r, k)
    prev = sim.ids[nodes[k - 1]] if k > 0 else SOURCE
    try:
        tail = sim.router.route_from(sim.view, need.start, prev, sim.session_tokens(r))
    except NoRouteError:
        return None
    out: list[tuple[int, LayerRange]] = []
    for stage in tail:
        j = sim.index[stage.peer_id]
        if j == leaving or j in nodes:
            return None
        out.append((j, LayerRange(stage.layers.start, min(stage.layers.end, need.end))))
        if stage.layers.end >= need.end:
            return out
    return None


def hand_over(sim: Simulation, i: int, r: int) -> bool:
    """Stream r's KV cache on node i to its successor(s); False when there is none (replay instead)."""
    if sim.done_s[r] >= 0:
        return True
    if sim.generated[r] == 0 or sim.replaying[r]:  # the KV is not complete on every stage yet
        return False
    nodes, starts = list(sim.routes[r]), list(sim.stage_starts[r])
    k = nodes.index(i)
    targets = successors(sim, r, k, i)
    if targets is None:
        return False
    sim.handovers += 1
    sim.epoch[r] += 1  # the step in flight is redone at stage k once the cache has arrived
    _release_on(sim, r, [i])
    _reserve_on(sim, r, [j for j, _ in targets])
    sim.routes[r] = tuple(nodes[:k] + [j for j, _ in targets] + nodes[k + 1 :])
    sim.stage_starts[r] = tuple(starts[:k] + [lr.start for _, lr in targets] + starts[k + 1 :])
    tokens, arrived_s = session_length(sim, r), sim.now
    for j, layers in targets:
        nbytes = kv_bytes(sim, len(layers), tokens)
        sim.handover_bytes += nbytes
        arrived_s = max(arrived_s, sim.transfer(i, j, nbytes))
    epoch = sim.epoch[r]
    sim.at(arrived_s, lambda: _resume(sim, r, epoch, k))
    return True


def _resume(sim: Simulation, r: int, epoch: int, k: int) -> None:
    if sim.epoch[r] != epoch or sim.done_s[r] >= 0:
        return  # the session moved again (or ended) while its cache streamed
    sim.stage[r] = k
    per_token = sim.token_bytes if k == 0 else sim.act_bytes
    send(sim, SRC, sim.routes[r][k], per_token * sim.quantum, [r << 8 | (epoch & 255)], False)


def hand_over_or_fail(sim: Simulation, i: int, sessions: list[int]) -> None:
    """Node i gives up `sessions`: hand each over where the feature is on and a successor exists."""
    for r in sessions:
        if not (sim.config.kv_handover and hand_over(sim, i, r)):
            sim.fail_over(r, i)
