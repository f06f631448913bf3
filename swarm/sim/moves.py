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

from swarm.errors import NoRouteError
from swarm.sim.config import SimConfig
from swarm.sim.events import EventQueue
from swarm.sim.links import Network
from swarm.sim.records import SRC, Counters, Node, Requests
from swarm.sim.view import SwarmView
from swarm.types import SOURCE, LayerRange, NodeID


class Moves:
    """Partial replay and KV hand-over for sessions whose node left or moved; keeps the sessions that wait
    for a route (`stalled`) and retries them when the swarm changes (`retry_stalled`)."""

    def __init__(
        self,
        nodes: list[Node],
        requests: Requests,
        view: SwarmView,
        network: Network,
        events: EventQueue,
        config: SimConfig,
        counters: Counters,
        num_layers: int,
        act_bytes: int,
        token_bytes: int,
    ) -> None:
        self.nodes = nodes
        self.index: dict[NodeID, int] = {node.id: i for i, node in enumerate(nodes)}
        self.requests = requests
        self.view = view
        self.network = network
        self.events = events
        self.config = config
        self.counters = counters
        self.num_layers = num_layers
        self.act_bytes = act_bytes
        self.token_bytes = token_bytes
        self.quantum = config.decode_quantum_tokens
        self.stalled: list[tuple[int, int]] = []  # (request, stage) failed over with no route yet

    def stage_layers(self, r: int, k: int) -> LayerRange:
        """The layers stage k of request r's route runs."""
        starts = self.requests.stage_starts[r]
        end = starts[k + 1] if k + 1 < len(starts) else self.num_layers
        return LayerRange(starts[k], end)

    def kv_bytes(self, layers: int, tokens: int) -> int:
        """KV cache of `tokens` tokens over `layers` layers: K and V, kv_heads * head_dim values each."""
        return int(2 * layers * self.act_bytes * self.config.kv_heads_fraction * tokens)

    def fail_over_partial(self, r: int, lost: int) -> None:
        """Node `lost` no longer serves session r: replace its stage only, and replay through the replacement."""
        requests = self.requests
        self.counters.failovers += 1
        requests.epoch[r] += 1  # tokens of r in flight anywhere are now stale
        self.view.release_moved(r, [lost], requests.session_tokens(r))
        self.replace_stage(r, list(requests.routes[r]).index(lost))

    def retry_stalled(self) -> None:
        """Sessions that failed over with no route try again (the swarm changed)."""
        if self.stalled:
            stalled, self.stalled = self.stalled, []
            for r, k in stalled:
                routes = self.requests.routes[r]
                if (
                    self.requests.done_s[r] < 0
                    and k < len(routes)
                    and r not in self.nodes[routes[k]].sessions
                ):
                    self.replace_stage(r, k)

    def replace_stage(self, r: int, k: int) -> None:
        """Route stage k of r anew, splice the new stages in, and replay the session through them."""
        requests = self.requests
        nodes, starts = list(requests.routes[r]), list(requests.stage_starts[r])
        prev = self.nodes[nodes[k - 1]].id if k > 0 else SOURCE
        try:
            tail = self.view.router.route_from(self.view.view, starts[k], prev, requests.session_tokens(r))
        except NoRouteError:
            self.stalled.append((r, k))
            return
        tail_nodes = [self.index[s.peer_id] for s in tail]
        tail_starts = [s.layers.start for s in tail]
        prefilling = requests.generated[r] == 0
        rejoin = None
        if not prefilling:  # rejoin the old route where a later stage still holds the session
            later = {starts[m]: m for m in range(k + 1, len(nodes)) if r in self.nodes[nodes[m]].sessions}
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
        need = requests.session_tokens(r)
        self.view.release_moved(r, dropped, need)
        self.view.reserve_missing(r, new_nodes[k:end], need)
        # A prompt still on its way through stages before k has not reached them: its prefill goes on from there.
        first = min(k, requests.stage[r]) if prefilling else k
        requests.routes[r], requests.stage_starts[r] = tuple(new_nodes), tuple(new_starts)
        requests.stage[r], requests.replay_end[r] = first, end
        requests.resume_stage[r] = 0 if prefilling else first
        requests.replaying[r] = True
        tokens = requests.length(r)
        self.counters.replayed_tokens += tokens * (end - first)
        per_token = self.token_bytes if first == 0 else self.act_bytes
        self.network.send(SRC, new_nodes[first], tokens * per_token, [(requests.key(r), tokens)], True)

    def successors(self, r: int, k: int, leaving: int) -> list[tuple[int, LayerRange]] | None:
        """Who takes stage k of r, and which of its layers each: the stages the router would route the session
        through after the previous stage, cut at the end of stage k (KV is per layer, so it splits). Usually
        one node holding the same layers. None when no route avoids the leaving node."""
        nodes = self.requests.routes[r]
        need = self.stage_layers(r, k)
        prev = self.nodes[nodes[k - 1]].id if k > 0 else SOURCE
        try:
            tail = self.view.router.route_from(
                self.view.view, need.start, prev, self.requests.session_tokens(r)
            )
        except NoRouteError:
            return None
        out: list[tuple[int, LayerRange]] = []
        for stage in tail:
            j = self.index[stage.peer_id]
            if j == leaving or j in nodes:
                return None
            out.append((j, LayerRange(stage.layers.start, min(stage.layers.end, need.end))))
            if stage.layers.end >= need.end:
                return out
        return None

    def hand_over(self, i: int, r: int) -> bool:
        """Stream r's KV cache on node i to its successor(s); False when there is none (replay instead)."""
        requests = self.requests
        if requests.done_s[r] >= 0:
            return True
        if requests.generated[r] == 0 or requests.replaying[r]:  # the KV is not complete on every stage yet
            return False
        nodes, starts = list(requests.routes[r]), list(requests.stage_starts[r])
        k = nodes.index(i)
        targets = self.successors(r, k, i)
        if targets is None:
            return False
        self.counters.handovers += 1
        requests.epoch[r] += 1  # the step in flight is redone at stage k once the cache has arrived
        need = requests.session_tokens(r)
        self.view.release_moved(r, [i], need)
        self.view.reserve_missing(r, [j for j, _ in targets], need)
        requests.routes[r] = tuple(nodes[:k] + [j for j, _ in targets] + nodes[k + 1 :])
        requests.stage_starts[r] = tuple(starts[:k] + [lr.start for _, lr in targets] + starts[k + 1 :])
        tokens, arrived_s = requests.length(r), self.events.now
        for j, layers in targets:
            nbytes = self.kv_bytes(len(layers), tokens)
            self.counters.handover_bytes += nbytes
            arrived_s = max(arrived_s, self.network.transfer(i, j, nbytes))
        epoch = requests.epoch[r]
        self.events.at(arrived_s, lambda: self._resume(r, epoch, k))
        return True

    def _resume(self, r: int, epoch: int, k: int) -> None:
        requests = self.requests
        if requests.epoch[r] != epoch or requests.done_s[r] >= 0:
            return  # the session moved again (or ended) while its cache streamed
        requests.stage[r] = k
        per_token = self.token_bytes if k == 0 else self.act_bytes
        self.network.send(SRC, requests.routes[r][k], per_token * self.quantum, [requests.key(r)], False)
