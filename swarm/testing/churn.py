"""Churn on real peers: clients generate without pause while one peer leaves (SIGTERM) and comes back, then
another crashes (SIGKILL) and comes back. Used by tests/integration/test_churn_real.py and
scripts/bench_churn.py --real.

Every moment is chosen by the clients' progress, never by the clock: before each event a seeded client and a
seeded token count are drawn, and the event fires once that client has produced that many more tokens. The
peer that leaves is drawn (seeded) from that client's current route, so the event always hits a live session;
the bootstrap peer (the first) never leaves, and a peer whose leaving would uncover a layer is never drawn.

The clients are whatever ``answer`` does (this package may not import the client: see the layering test); each
call is one request, reporting each token with the peer ids of its current route. Figures per event (the
window from the event to the next): the largest gap between a client's consecutive tokens (a request's start
counts as a token, so a first token's wait counts too), failovers, and tokens replayed.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import signal
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import psutil

from swarm.testing.launcher import LocalSwarm, PeerProcess

MIB = 1024 * 1024


@dataclass(frozen=True)
class ChurnConfig:
    """One churn scenario; `layouts[i]` is peer i's layer range ("A:B"), the first peer is the bootstrap."""

    layouts: tuple[str, ...]
    prompts: tuple[tuple[int, ...], ...]  # client c's request r uses prompts[(c + r) % len(prompts)]
    new_tokens: int = (
        10  # tokens of every answer (an event fires mid-answer: never at an answer's last token)
    )
    clients: int = 4
    seed: int = 0
    tokens_between_events: tuple[int, int] = (6, 18)  # a seeded count in [lo, hi] of one client's tokens
    requests_after: int = 1  # after the last event, each client completes this many more requests
    peer_args: tuple[str, ...] = ()
    ready_timeout_s: float = 180.0  # for a peer to be serving
    exit_timeout_s: float = 60.0  # for a SIGTERMed peer to exit, a SIGKILLed peer's children to go
    progress_timeout_s: float = 180.0  # for a client to produce the tokens an event waits for
    think_s: float = 0.0  # a client's pause between its requests (a user reading the answer)
    # the SIGKILL only once the SIGTERMed peer is serving again (where the layout has single holders, the kill
    # can then hit a live route); by default the two leaves and returns overlap
    kill_after_return: bool = False


@dataclass(frozen=True)
class Answer:
    """One request as a client saw it."""

    tokens: list[int]
    replayed_tokens: int  # tokens its failovers sent again
    failovers: list[tuple[float, str]]  # (time.monotonic() of the failover, "Error/detected_by/action")


OnToken = Callable[[Sequence[str]], None]  # after each token: the peer ids of the session's current route


class Answerer(Protocol):
    def __call__(self, client: int, prompt: Sequence[int], on_token: OnToken) -> Awaitable[Answer]: ...


@dataclass
class Request:
    client: int
    prompt: int  # index into ChurnConfig.prompts
    started_s: float
    times: list[float] = field(default_factory=list)  # time.monotonic() of its start and of each token
    answer: Answer | None = None
    error: str | None = None  # the exception, if the request failed


@dataclass
class Event:
    kind: str  # "sigterm", "sigkill" or "restart"
    peer: str  # the name of the peer that left, or of the one started
    trigger: str  # e.g. "client 2 after 13 tokens"
    at_s: float  # time.monotonic() of the signal, or of the restart's launch
    done_s: float = 0.0  # when the peer had exited (and its children gone), or was serving again
    left_behind: list[str] = field(default_factory=list)  # a SIGKILLed peer's children still running
    on_route: bool = False  # whether the peer that left was on the route of the client that triggered it
    children: list[psutil.Process] = field(default_factory=list, repr=False)  # the peer's, at the signal


class ChurnRun:
    """Run the scenario on `swarm` (its first len(layouts) peers started, serving, in the layouts' order)."""

    def __init__(self, swarm: LocalSwarm, config: ChurnConfig, answer: Answerer) -> None:
        self.swarm, self.config, self.answer = swarm, config, answer
        self.layers = {p.name: layout for p, layout in zip(swarm.peers, config.layouts, strict=True)}
        self.bootstrap = swarm.peers[0].name
        self.original = set(self.layers)  # the peers started before the run (restarts are added to layers)
        self.gone: set[str] = set()  # peers that were signalled
        self.tokens = [0] * config.clients
        self.in_answer = [0] * config.clients  # tokens so far of each client's current answer
        self.routes: list[Sequence[str]] = [() for _ in range(config.clients)]
        self.progress = [asyncio.Event() for _ in range(config.clients)]
        self.requests: list[Request] = []
        self.events: list[Event] = []
        self.rss_before: dict[str, int] = {}
        self.rss_after: dict[str, int] = {}
        self.warm_s = self.end_s = 0.0
        self._stop = asyncio.Event()

    async def run(self) -> None:
        async with asyncio.TaskGroup() as group:
            for c in range(self.config.clients):
                group.create_task(self._client(c))
            try:
                await self._events(random.Random(self.config.seed))
            finally:
                self._stop.set()
        self.end_s = time.monotonic()
        self.rss_after = self._rss(self.survivors())

    def survivors(self) -> list[PeerProcess]:
        """The peers that never left."""
        return [p for p in self.swarm.peers if p.name in self.original and p.name not in self.gone]

    async def _client(self, c: int) -> None:
        after_stop = 0
        for r in itertools.count():
            if self._stop.is_set():
                if after_stop == self.config.requests_after:
                    return
                after_stop += 1
            prompt = (c + r) % len(self.config.prompts)
            request = Request(c, prompt, time.monotonic())
            request.times.append(request.started_s)
            self.requests.append(request)
            try:
                request.answer = await self.answer(c, self.config.prompts[prompt], self._on_token(request))
            except Exception as error:  # counted as a failed request; the client goes on
                request.error = f"{type(error).__name__}: {error}"
            # a failing swarm is not hammered in a tight loop
            await asyncio.sleep(max(self.config.think_s, 0.0 if request.answer else 0.1))

    def _on_token(self, request: Request) -> OnToken:
        c = request.client

        def on_token(route: Sequence[str]) -> None:
            request.times.append(time.monotonic())
            self.tokens[c] += 1
            self.in_answer[c] = len(request.times) - 1
            self.routes[c] = route
            self.progress[c].set()

        return on_token

    async def _events(self, rng: random.Random) -> None:
        """SIGTERM one peer, then SIGKILL another; each comes back once it has gone and a client has made
        progress. The two leaves and returns overlap, as they would in a real swarm (and the run stays short)."""
        for c in range(self.config.clients):  # warm: every client has produced a token
            await self._wait_tokens(c, 1)
        self.warm_s = time.monotonic()
        self.rss_before = self._rss(self.swarm.peers)
        async with asyncio.TaskGroup() as returns:
            first: asyncio.Task[None] | None = None
            for kind in ("sigterm", "sigkill"):
                (c, n), back = self._draw(rng), self._draw(rng)
                if first is not None and self.config.kill_after_return:
                    await first
                await self._wait_tokens(c, self.tokens[c] + n)
                peer = self._victim(rng, self.routes[c])
                event = self._signal(peer, kind, f"client {c} after {n} tokens")
                event.on_route = peer.peer_id in self.routes[c]
                first = returns.create_task(self._gone_then_back(peer, event, back))

    def _draw(self, rng: random.Random) -> tuple[int, int]:
        """(client, tokens): the next moment is once that client has produced that many more tokens."""
        return rng.randrange(self.config.clients), rng.randint(*self.config.tokens_between_events)

    async def _wait_tokens(self, c: int, count: int) -> None:
        async with asyncio.timeout(self.config.progress_timeout_s):
            # an answer's last token closes its session: an event fired then would hit no session
            while self.tokens[c] < count or self.in_answer[c] >= self.config.new_tokens - 1:
                self.progress[c].clear()
                await self.progress[c].wait()

    def _victim(self, rng: random.Random, route: Sequence[str]) -> PeerProcess:
        """A peer of `route` (else any that was there from the start) that is not the bootstrap and whose
        leaving uncovers no layer."""
        live = [
            p for p in self.swarm.peers if p.is_ready() and p.proc.poll() is None and p.name not in self.gone
        ]
        can_go = [
            p
            for p in live
            if p.name in self.original and p.name != self.bootstrap and self._covered(live, without=p)
        ]
        # a restarted peer may go again only if it carries the live session (the survivors are the originals)
        movable = [p for p in live if p.name != self.bootstrap and self._covered(live, without=p)]
        on_route = [p for p in movable if p.peer_id in route]
        if not can_go:
            raise RuntimeError("no peer can leave without uncovering a layer: add replicas")
        return rng.choice(on_route or can_go)

    def _covered(self, live: list[PeerProcess], without: PeerProcess) -> bool:
        held: set[int] = set()
        for peer in live:
            if peer is not without:
                held.update(range(*_span(self.layers[peer.name])))
        return all(set(range(*_span(layout))) <= held for layout in self.layers.values())

    def _signal(self, peer: PeerProcess, kind: str, trigger: str) -> Event:
        event = Event(kind, peer.name, trigger, time.monotonic())
        self.events.append(event)
        self.gone.add(peer.name)
        event.children = psutil.Process(peer.proc.pid).children(recursive=True)
        # the peer's own process only, as `kill` does: its DHT child and p2pd must go by themselves
        os.kill(peer.proc.pid, signal.SIGTERM if kind == "sigterm" else signal.SIGKILL)
        return event

    async def _gone_then_back(self, peer: PeerProcess, event: Event, back: tuple[int, int]) -> None:
        await self._until(lambda: peer.proc.poll() is not None, f"{peer.name} to exit")
        if event.kind == "sigkill":
            children = event.children
            if not await self._until(lambda: not _running(children), "", fail=False):
                event.left_behind = [f"{p.pid} {p.name()}" for p in children if _running([p])]
        event.done_s = time.monotonic()
        c, n = back
        await self._wait_tokens(c, self.tokens[c] + n)
        name = f"{peer.name}_again"
        restart = Event("restart", name, f"client {c} after {n} tokens", time.monotonic())
        self.events.append(restart)
        self.layers[name] = self.layers[peer.name]
        args = self.config.peer_args
        again = self.swarm.start_peer(self.layers[name], name=name, extra_args=args, wait=False)
        await asyncio.to_thread(again.wait_ready, self.config.ready_timeout_s)
        restart.done_s = time.monotonic()

    async def _until(self, done: Callable[[], bool], what: str, fail: bool = True) -> bool:
        deadline = time.monotonic() + self.config.exit_timeout_s
        while not done():
            if time.monotonic() > deadline:
                if fail:
                    raise TimeoutError(f"waited {self.config.exit_timeout_s:.0f} s for {what}")
                return False
            await asyncio.sleep(0.05)
        return True

    def _rss(self, peers: Sequence[PeerProcess]) -> dict[str, int]:
        return {p.name: rss for p in peers if (rss := rss_bytes(p.proc.pid)) is not None}

    def figures(self, expected: Sequence[Sequence[int]]) -> dict[str, Any]:
        """The run as JSON-ready figures; `expected[i]`: the greedy tokens of prompts[i] by local transformers."""
        done = [r for r in self.requests if r.answer is not None]
        self.events.sort(key=lambda e: e.at_s)
        bounds = [e.at_s for e in self.events] + [self.end_s]
        return {
            "requests": len(self.requests),
            "completed": len(done),
            "failed": len(self.requests) - len(done),
            "errors": sorted({r.error for r in self.requests if r.error}),
            "exact": all(r.answer.tokens == list(expected[r.prompt]) for r in done if r.answer),
            "mismatched": sum(1 for r in done if r.answer and r.answer.tokens != list(expected[r.prompt])),
            "tokens": sum(self.tokens),
            "max_gap_healthy_s": self._max_gap(self.warm_s, bounds[0]),
            "max_ttft_healthy_s": self._max_ttft(self.warm_s, bounds[0]),
            "events": [
                self._event_figures(e, e.at_s, end) for e, end in zip(self.events, bounds[1:], strict=True)
            ],
            "rss_mib": {
                name: {"before": self.rss_before.get(name, 0) / MIB, "after": rss / MIB}
                for name, rss in self.rss_after.items()
            },
        }

    def _event_figures(self, event: Event, start: float, end: float) -> dict[str, Any]:
        failovers = [
            (at, what, r)
            for r in self.requests
            if r.answer
            for at, what in r.answer.failovers
            if start <= at < end
        ]
        replayed = {id(r): r.answer.replayed_tokens for _, _, r in failovers if r.answer}
        return {
            "kind": event.kind,
            "peer": event.peer,
            "trigger": event.trigger,
            "on_route": event.on_route,
            "at_s": event.at_s - self.warm_s,  # from the moment every client was generating
            "took_s": event.done_s - event.at_s,  # to exit (and children gone), or to serve again
            "max_gap_s": self._max_gap(start, end),
            "max_ttft_s": self._max_ttft(start, end),
            "failovers": len(failovers),
            "tokens_replayed": sum(replayed.values()),
            "failover_log": [f"{at - self.warm_s:.2f}s {what}" for at, what, _ in sorted(failovers)],
            "left_behind": event.left_behind,
        }

    def _max_gap(self, start: float, end: float) -> float:
        """The largest gap between consecutive tokens of a request that ended in [start, end): the pause a
        reader of a streamed answer sees (the wait for a first token is ``_max_ttft``)."""
        gaps = [
            b - a
            for r in self.requests
            for a, b in zip(r.times[1:], r.times[2:], strict=False)
            if start <= b < end
        ]
        return max(gaps, default=0.0)

    def _max_ttft(self, start: float, end: float) -> float:
        """The longest wait from a request's start to its first token, for first tokens in [start, end)."""
        waits = [
            r.times[1] - r.times[0] for r in self.requests if len(r.times) > 1 and start <= r.times[1] < end
        ]
        return max(waits, default=0.0)


def _span(layout: str) -> tuple[int, int]:
    start, end = layout.split(":")
    return int(start), int(end)


def _running(processes: Sequence[psutil.Process]) -> bool:
    """Whether any of `processes` still runs (a zombie counts as gone: only its parent can reap it)."""
    for p in processes:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            continue
    return False


def rss_bytes(pid: int) -> int | None:
    """Resident memory of process `pid` from /proc (None once it has gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None
