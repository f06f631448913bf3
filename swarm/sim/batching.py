"""Per-node continuous batching in the simulation: what one iteration takes in, how long it runs, where its
outputs go.

A node runs iterations back to back while it has work: every decode token waiting when an iteration starts
joins it (up to max_batch_tokens), plus prefill jobs up to prefill_budget_tokens, plus up to
replay_chunk_tokens of replays (chunked, so decode keeps going). Iteration time comes from the node's timing
model (swarm/sim/timing.py); on a shared host the iteration is handed to the host's processor sharing
(swarm/sim/hosts.py). When it ends, a node's outputs for the same next hop travel as one message.
"""

from __future__ import annotations

from swarm.sim.config import SimConfig
from swarm.sim.events import EventQueue
from swarm.sim.links import Network
from swarm.sim.records import NODE_DONE, SNK, Node, Requests


class Batcher:
    """Runs every node's iterations: `deliver_*` when work arrives, `finish` when an iteration ends."""

    def __init__(
        self,
        nodes: list[Node],
        requests: Requests,
        network: Network,
        events: EventQueue,
        config: SimConfig,
        act_bytes: int,
        token_bytes: int,
    ) -> None:
        self.nodes = nodes
        self.requests = requests
        self.network = network
        self.events = events
        self.config = config
        self.quantum = config.decode_quantum_tokens
        self.cap = config.max_batch_tokens
        self.act_bytes = act_bytes
        self.token_bytes = token_bytes
        self._send = network.send  # bound once: called per message
        self._push = events.push  # and per iteration

    def deliver_decode(self, i: int, message: tuple[int, list[int]]) -> None:
        """Decode tokens reach node i: (its incarnation when they were sent, keys); dropped if it died or
        reloaded since."""
        node = self.nodes[i]
        if node.alive and node.incarnation == message[0]:
            node.decode_q.extend(message[1])
            if not node.busy:
                self.start(node, i)

    def deliver_prefill(self, i: int, message: tuple[int, list[tuple[int, int]]]) -> None:
        node = self.nodes[i]
        if node.alive and node.incarnation == message[0]:
            self.queue_prefill(node, message[1])
            if not node.busy:
                self.start(node, i)

    def queue_prefill(self, node: Node, jobs: list[tuple[int, int]]) -> None:
        """Prefill jobs arrive at a node: replays (and prompts, with prompt_chunk_tokens) go to the chunked
        queue when chunking is on for them."""
        replays, prompts = self.config.replay_chunk_tokens > 0, self.config.prompt_chunk_tokens > 0
        if not replays and not prompts:
            node.prefill_q.extend(jobs)
            return
        replaying = self.requests.replaying
        for key, tokens in jobs:
            if replays if replaying[key >> 8] else prompts:
                node.replay_q.append([key, tokens, tokens])
            else:
                node.prefill_q.append((key, tokens))

    def take_replays(self, node: Node) -> None:
        """Up to replay_chunk_tokens (or prompt_chunk_tokens) of the chunked queue join this iteration (chunked
        prefill): decode keeps going."""
        left = max(self.config.replay_chunk_tokens, self.config.prompt_chunk_tokens)
        taken, finished = 0, []
        while node.replay_q and left > 0:
            job = node.replay_q[0]
            take = min(job[1], left)
            job[1] -= take
            left -= take
            taken += take
            if job[1] == 0:
                node.replay_q.popleft()
                finished.append((job[0], job[2]))
        node.cur_replay, node.cur_replay_tokens = finished, taken

    def start(self, node: Node, i: int) -> None:
        """Node i is idle: batch what is waiting into one iteration and schedule its end (no-op without work)."""
        if node.prefill_q:
            budget, tokens = self.config.prefill_budget_tokens, 0
            jobs: list[tuple[int, int]] = []
            while node.prefill_q and (not jobs or tokens + node.prefill_q[0][1] <= budget):
                job = node.prefill_q.popleft()
                jobs.append(job)
                tokens += job[1]
            node.cur_prefill = jobs
        if node.replay_q:
            self.take_replays(node)
        if not node.cur_prefill and not node.cur_replay_tokens and not node.decode_q:
            return
        cap, queued = self.cap, node.decode_q
        if len(queued) > cap:
            node.cur_decode, node.decode_q = queued[:cap], queued[cap:]
        else:
            node.cur_decode, node.decode_q = queued, []
        timing = node.timing
        assert timing is not None
        iter_s = node.decode_iter_s
        if node.cur_prefill or node.cur_replay_tokens:
            dt = timing.prefill_s(sum(t for _, t in node.cur_prefill) + node.cur_replay_tokens)
            if node.cur_decode:  # decode tokens ride along; the fixed per-iteration cost is paid once
                dt += max(iter_s[len(node.cur_decode)] - iter_s[0], 0.0)
        else:
            dt = iter_s[len(node.cur_decode)]
        if timing.forward_s:
            dt += timing.forward_s * self._forwarded_sessions(node)
        node.busy = True
        node.busy_s += dt
        if node.host is None:
            self._push(self.events.now + dt, NODE_DONE, i, node.incarnation)
        else:
            node.host.start(self.events.now, i, dt, self.events.schedule_host)

    def _forwarded_sessions(self, node: Node) -> int:
        """Sessions of the iteration about to run whose next hop is another node (one RPC each)."""
        stage, routes = self.requests.stage, self.requests.routes
        decode = sum(1 for key in node.cur_decode if stage[key >> 8] + 1 < len(routes[key >> 8]))
        prefill = sum(1 for key, _ in node.cur_prefill if stage[key >> 8] + 1 < len(routes[key >> 8]))
        return decode * self.quantum + prefill

    def finish(self, i: int, incarnation: int) -> None:
        """Node i's iteration ended: send its outputs on (grouped by next hop), then start the next one."""
        node = self.nodes[i]
        if not node.alive or node.incarnation != incarnation:
            return
        node.busy = False
        if len(node.cur_decode) == 1:
            self._send_one_decode(i, node)
        elif node.cur_decode:
            self._send_decodes(i, node)
        if node.cur_prefill or node.cur_replay:
            self._send_prefills(i, node)
        self.start(node, i)

    def _send_one_decode(self, i: int, node: Node) -> None:
        # One token is the common case in a big, lightly loaded cluster: no grouping (docs/benchmarks.md).
        requests = self.requests
        key = node.cur_decode[0]
        r = key >> 8
        if key & 255 == requests.epoch[r] & 255:
            s = requests.stage[r] + 1
            route = requests.routes[r]
            requests.stage[r] = s
            nxt = route[s] if s < len(route) else SNK
            self._send(i, nxt, self.act_bytes * self.quantum, node.cur_decode, False)
        node.cur_decode = []

    def _send_decodes(self, i: int, node: Node) -> None:
        epoch, stage, routes = self.requests.epoch, self.requests.stage, self.requests.routes
        groups: dict[int, list[int]] = {}
        for key in node.cur_decode:
            r = key >> 8
            if key & 255 != epoch[r] & 255:
                continue  # the session failed over while this token was here
            s = stage[r] + 1
            route = routes[r]
            nxt = route[s] if s < len(route) else SNK
            stage[r] = s
            group = groups.get(nxt)
            if group is None:
                groups[nxt] = [key]
            else:
                group.append(key)
        for nxt, keys in groups.items():
            self._send(i, nxt, len(keys) * self.act_bytes * self.quantum, keys, False)
        node.cur_decode = []

    def _send_prefills(self, i: int, node: Node) -> None:
        requests = self.requests
        epoch, stage, routes = requests.epoch, requests.stage, requests.routes
        for key, tokens in node.cur_prefill + node.cur_replay:
            r = key >> 8
            if key & 255 != epoch[r] & 255:
                continue
            s = stage[r] + 1
            stage[r] = s
            if s >= len(routes[r]):
                self._send(i, SNK, tokens * self.act_bytes, [(key, tokens)], True)
            elif s >= requests.replay_end[r]:  # a partial replay: the next stage kept its cache
                self._send(i, SNK, self.token_bytes, [(key, tokens)], True)
            else:
                self._send(i, routes[r][s], tokens * self.act_bytes, [(key, tokens)], True)
        node.cur_prefill, node.cur_replay, node.cur_replay_tokens = [], [], 0
