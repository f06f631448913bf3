"""SwarmClient: generate text with a model whose layers are served by a swarm of peers.

    from client import SwarmClient
    with SwarmClient(initial_peers=["/ip4/127.0.0.1/tcp/31337/p2p/Qm..."], model="default") as swarm:
        print(swarm.generate("What is the capital of France?", max_new_tokens=20))

AsyncSwarmClient is the real client (one asyncio loop); SwarmClient is a thin synchronous facade that runs an
AsyncSwarmClient on a private event loop in a background thread. The client holds the tokenizer, embeddings
and LM head; every prompt becomes one InferenceSession over a route the swarm's plan picks.
"""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
import threading
import time
from collections.abc import AsyncGenerator, Awaitable, Coroutine, Iterator, Sequence
from contextlib import aclosing
from dataclasses import replace
from typing import Any, TypeVar

from client.batching import BatchedSession, HeadBatcher
from client.chain import RemoteChain
from client.config import ClientConfig
from client.draft_model import load_draft_model
from client.drafting import ModelDrafters, make_speculation
from client.generation import GenerationRequest, generate_ids, generate_text
from client.liveness import LivenessConfig, StepWatch
from client.retry import RetryPolicy
from client.routes import SwarmRoutes
from client.session import Chain, Head, InferenceSession, RouteSource
from client.spot import DirectoryReports, ReportSink, SpotChecker
from swarm.dht import DHTConfig, Directory, ModelShape, SwarmDHT
from swarm.errors import ModelMismatch, SwarmError
from swarm.models.head import Sampler, SamplingParams
from swarm.models.heap import freeze_loaded
from swarm.models.loading import resolve_model
from swarm.models.spec import torch_dtype
from swarm.models.threads import name_os_thread
from swarm.routing import BanConfig
from swarm.transport import call_info, call_probe

logger = logging.getLogger(__name__)

# the synchronous facade's event loop thread, in Python and in the OS (swarm.models.threads)
LOOP_THREAD = "swarm-client"

T = TypeVar("T")
Message = dict[str, str]


class AsyncSwarmClient:
    """The asyncio client. Build with `await AsyncSwarmClient.create(...)`; end with `await close()`.

    The constructor takes its parts ready-made (chain, routes, head, tokenizer), so tests can run the same
    client over in-process blocks; `create` wires the real ones: DHT, P2P, routes from the swarm's plan.
    """

    def __init__(
        self,
        config: ClientConfig,
        *,
        chain: Chain,
        routes: RouteSource,
        head: Head,
        tokenizer: Any,
        dht: SwarmDHT | None = None,
        reports: ReportSink | None = None,
        draft: ModelDrafters | None = None,
    ) -> None:
        """``draft``: the model speculate="model" or "self" drafts with (client.draft_model)."""
        if draft is None and config.speculate in ("model", "self"):
            raise ValueError(f"speculate={config.speculate!r} needs a draft model: load_draft_model makes it")
        self.config = config
        self.draft = draft
        self.chain = chain
        self.routes = routes
        self.head = head
        self.tokenizer = tokenizer
        self.dht = dht
        self.policy = RetryPolicy(
            config.max_retries, config.retry_delay_s, config.route_wait_s, config.route_poll_s
        )
        liveness = LivenessConfig(config.probe_factor, config.probe_after_s, config.probe_timeout_s)
        self.watch = StepWatch(chain.find_silent, liveness)  # shared: expected step times are per swarm
        self.eos_ids = _eos_ids(tokenizer)
        self.checker = SpotChecker(
            chain,
            routes,
            head,
            rate=config.spot_check_rate,
            window_tokens=config.spot_check_tokens,
            reports=reports,
            rng=random.Random(config.spot_check_seed),
            timeout_s=config.step_timeout_s,
            blocking=config.spot_check_blocking,
        )
        # the norm + LM head of concurrent generations run as one batched call per round (client.batching)
        self.batcher = HeadBatcher(head, lanes=config.batch_lanes, settle_s=config.round_settle_s)
        self.last_session: InferenceSession | None = None  # the latest session, for failover counts in tests

    @classmethod
    async def create(
        cls,
        initial_peers: Sequence[str] = (),
        model: str | None = None,
        config: ClientConfig | None = None,
        reports: ReportSink | None = None,
    ) -> AsyncSwarmClient:
        """Load the tokenizer and head of `model`, join the swarm's DHT as a client, wait for all layers.

        `reports` receives the peers spot-checks catch computing wrongly (default: signed reports in the DHT)."""
        config = config or ClientConfig()
        config = replace(config, initial_peers=tuple(initial_peers), model=model or config.model)
        if not config.initial_peers:
            raise ValueError("initial_peers is empty: give the multiaddr of at least one running peer")
        source = await asyncio.to_thread(resolve_model, config.model)  # may convert a checkpoint once
        spec = source.spec
        head = await asyncio.to_thread(source.load_head, config.device, config.dtype)
        tokenizer = await asyncio.to_thread(source.tokenizer)
        draft = await asyncio.to_thread(load_draft_model, config, source, head, tokenizer)
        dht = await SwarmDHT.create(
            DHTConfig(initial_peers=config.initial_peers, client_mode=True), spec.weights_hash
        )
        try:
            p2p = await dht.replicate_p2p()
            await _check_model(
                p2p, config.initial_peers, spec.weights_hash, spec.name, config.connect_timeout_s
            )
            directory = Directory(dht, shape=ModelShape(spec.num_layers, spec.hidden_size))
            routes = SwarmRoutes(
                directory.snapshot,
                spec.num_layers,
                cache_high_water=config.cache_high_water,
                snapshot_max_age_s=config.snapshot_max_age_s,
                bans=BanConfig(base_s=config.ban_initial_s, max_s=config.ban_max_s),
                min_reporters=config.min_reporters,
                max_layer_tokens_s=config.max_layer_tokens_s,
                rng=random.Random(),  # seeded by the OS: another client's routes start elsewhere
                ping=lambda peer_id: _round_trip_s(p2p, peer_id, routes.maddrs(peer_id)),
                quant=config.quant,
            )
            await routes.wait_for_coverage(config.connect_timeout_s)
            chain = RemoteChain(
                p2p,
                routes.maddrs,
                spec.weights_hash,
                torch_dtype(spec.dtype),
                config.step_timeout_s,
                config.close_timeout_s,
                config.group_messages,
                config.activations,
                routes.record,
            )
        except BaseException:
            await dht.aclose()
            raise
        logger.info("connected to the swarm serving %s (%d layers)", spec.name, spec.num_layers)
        if config.freeze_heap:
            freeze_loaded()
        if reports is None:  # what our spot-checks catch, the planner and other clients learn through the DHT
            reports = DirectoryReports(directory)
        return cls(
            config,
            chain=chain,
            routes=routes,
            head=head,
            tokenizer=tokenizer,
            dht=dht,
            reports=reports,
            draft=draft,
        )

    # --- prompts -------------------------------------------------------------------------------------------

    def encode(self, prompt: str | None = None, messages: Sequence[Message] | None = None) -> list[int]:
        """Token ids of a plain prompt, or of chat `messages` rendered with the model's chat template."""
        if (prompt is None) == (messages is None):
            raise ValueError("give exactly one of prompt= or messages=")
        if self.tokenizer is None:
            raise ValueError(
                "this model has no tokenizer (the tiny test model): use generate_ids with token ids"
            )
        if messages is not None:
            for m in messages:
                if (
                    not isinstance(m, dict)
                    or not isinstance(m.get("role"), str)
                    or not isinstance(m.get("content"), str)
                ):
                    raise ValueError(f"each message must be {{'role': str, 'content': str}}, got {m!r}")
            if not getattr(self.tokenizer, "chat_template", None):
                raise ValueError("this model's tokenizer has no chat template: pass prompt= instead")
            text = self.tokenizer.apply_chat_template(
                list(messages), add_generation_prompt=True, tokenize=False
            )
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        if not isinstance(prompt, str):
            raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
        return list(self.tokenizer(prompt)["input_ids"])

    def _request(
        self, ids: Sequence[int], max_new_tokens: int, stop: str | Sequence[str] | None
    ) -> GenerationRequest:
        stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
        return GenerationRequest(tuple(ids), max_new_tokens, self.eos_ids, stops)

    def new_session(self, max_length_tokens: int) -> InferenceSession:
        """An inference session reserving `max_length_tokens` of KV cache on each peer of its route."""
        session = BatchedSession(
            self.batcher,
            self.chain,
            self.routes,
            self.policy,
            self.config.step_timeout_s,
            max_length_tokens,
            self.checker,
            self.watch,
            self.config.prefill_chunk_tokens,
        )
        session.speculation = make_speculation(self.config.speculate, self.config.draft_tokens, self.draft)
        self.last_session = session
        return session

    # --- generation ----------------------------------------------------------------------------------------

    async def stream(
        self,
        prompt: str | None = None,
        messages: Sequence[Message] | None = None,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        repetition_penalty: float = 1.0,
        stop: str | Sequence[str] | None = None,
        seed: int | None = None,
    ) -> AsyncGenerator[str, None]:
        """Yield pieces of the answer as tokens arrive (whole characters only); stop strings are not yielded."""
        request = self._request(self.encode(prompt, messages), max_new_tokens, stop)
        sampler = _sampler(temperature, top_p, top_k, repetition_penalty, seed)
        session = self.new_session(len(request.prompt_ids) + max_new_tokens)
        try:
            greedy = sampler.params.greedy
            target = None if greedy else sampler  # a greedy pick verifies drafts by itself
            pieces_of = generate_text(
                session, request, sampler.sample, self.tokenizer, greedy, session.speculation, target
            )
            async with aclosing(pieces_of) as pieces:
                async for piece in pieces:
                    yield piece
        finally:
            await session.close()

    async def generate(
        self, prompt: str | None = None, messages: Sequence[Message] | None = None, **kwargs: Any
    ) -> str:
        """The whole answer as one string; takes the same arguments as `stream`."""
        return "".join([piece async for piece in self.stream(prompt, messages, **kwargs)])

    async def generate_ids(
        self, input_ids: Sequence[int], max_new_tokens: int, params: SamplingParams, yield_eos: bool = False
    ) -> list[int]:
        """New token ids after `input_ids` (for client.hf); the EOS that ends them is included if `yield_eos`."""
        request = GenerationRequest(tuple(input_ids), max_new_tokens, self.eos_ids, yield_eos=yield_eos)
        session = self.new_session(len(input_ids) + max_new_tokens)
        try:
            sampler = Sampler(params)
            target = None if params.greedy else sampler
            tokens = generate_ids(
                session, request, sampler.sample, params.greedy, session.speculation, target
            )
            return [t async for t in tokens]
        finally:
            await session.close()

    async def generate_ids_batch(
        self,
        rows: Sequence[Sequence[int]],
        max_new_tokens: int,
        params: SamplingParams,
        yield_eos: bool = False,
    ) -> list[list[int]]:
        """`generate_ids` for every row at once: concurrent sessions, their head work batched each round."""
        return list(
            await asyncio.gather(*(self.generate_ids(r, max_new_tokens, params, yield_eos) for r in rows))
        )

    async def close(self) -> None:
        """Leave the swarm: close our P2P connection to the daemon, then stop the DHT child and its p2pd."""
        self.batcher.close()
        await self.checker.aclose()
        if isinstance(self.chain, RemoteChain):
            await self.chain.aclose()
            await self.chain.p2p.shutdown()
        if self.dht is not None:
            dht, self.dht = self.dht, None
            await dht.aclose()

    async def __aenter__(self) -> AsyncSwarmClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class SwarmClient:
    """Synchronous facade: the same methods as AsyncSwarmClient, run on a private loop in a daemon thread."""

    def __init__(
        self,
        initial_peers: Sequence[str] = (),
        model: str | None = None,
        config: ClientConfig | None = None,
        reports: ReportSink | None = None,
        **config_fields: Any,
    ) -> None:
        config = replace(config or ClientConfig(), **config_fields)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name=LOOP_THREAD, daemon=True)
        self._thread.start()
        try:
            self._client = self.run(AsyncSwarmClient.create(initial_peers, model, config, reports))
        except BaseException:
            self._stop_loop()
            raise

    @property
    def aclient(self) -> AsyncSwarmClient:
        return self._client

    def run(self, coro: Coroutine[Any, Any, T] | Awaitable[T]) -> T:
        """Run a coroutine on the client's loop and wait for its result (for AsyncSwarmClient calls)."""
        return asyncio.run_coroutine_threadsafe(_await(coro), self._loop).result()

    def generate(
        self, prompt: str | None = None, messages: Sequence[Message] | None = None, **kwargs: Any
    ) -> str:
        return self.run(self._client.generate(prompt, messages, **kwargs))

    def stream(
        self, prompt: str | None = None, messages: Sequence[Message] | None = None, **kwargs: Any
    ) -> Iterator[str]:
        pieces = self._client.stream(prompt, messages, **kwargs)
        try:
            while True:
                try:
                    yield self.run(pieces.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            self.run(pieces.aclose())  # type: ignore[attr-defined]

    def generate_ids(
        self, input_ids: Sequence[int], max_new_tokens: int, params: SamplingParams, yield_eos: bool = False
    ) -> list[int]:
        return self.run(self._client.generate_ids(input_ids, max_new_tokens, params, yield_eos))

    def generate_ids_batch(
        self,
        rows: Sequence[Sequence[int]],
        max_new_tokens: int,
        params: SamplingParams,
        yield_eos: bool = False,
    ) -> list[list[int]]:
        return self.run(self._client.generate_ids_batch(rows, max_new_tokens, params, yield_eos))

    @property
    def tokenizer(self) -> Any:
        return self._client.tokenizer

    def close(self) -> None:
        if self._loop.is_closed():
            return
        try:
            self.run(self._client.close())
        finally:
            self._stop_loop()

    def _run_loop(self) -> None:
        name_os_thread(LOOP_THREAD)
        self._loop.run_forever()

    def _stop_loop(self) -> None:
        # hivemind leaves reader tasks on the loop; cancel and await them so none dies with the loop.
        self.run(_cancel_leftover_tasks())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def __enter__(self) -> SwarmClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def _cancel_leftover_tasks() -> None:
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _await(awaitable: Awaitable[T]) -> T:
    return await awaitable


def _sampler(
    temperature: float, top_p: float, top_k: int, repetition_penalty: float, seed: int | None
) -> Sampler:
    seed = secrets.randbits(63) if seed is None else seed
    return Sampler(SamplingParams(temperature, top_k, top_p, repetition_penalty, seed))


def _eos_ids(tokenizer: Any) -> frozenset[int]:
    """Token ids that end generation: the tokenizer's EOS (for chat models, the end-of-turn token)."""
    ids = {tokenizer.eos_token_id} if getattr(tokenizer, "eos_token_id", None) is not None else set()
    return frozenset(int(i) for i in ids)


async def _round_trip_s(p2p: Any, peer_id: str, maddrs: tuple[str, ...]) -> float:
    """This client's round trip to `peer_id`: an empty probe, timed."""
    started = time.perf_counter()
    await call_probe(p2p, peer_id, maddrs=maddrs)
    return time.perf_counter() - started


async def _check_model(
    p2p: Any, initial_peers: Sequence[str], weights_hash: str, name: str, timeout_s: float
) -> None:
    """ModelMismatch when the initial peers serve other weights than the client loaded.

    Records live under a key derived from the model hash, so a client with the wrong model would just see
    an empty swarm; asking the initial peers directly turns that into a clear error.
    """
    seen: dict[str, str] = {}
    for maddr in initial_peers:
        peer_id = maddr.rsplit("/p2p/", 1)[-1] if "/p2p/" in maddr else None
        if peer_id is None:
            continue
        try:
            info = await call_info(
                p2p, peer_id, maddrs=[maddr.rsplit("/p2p/", 1)[0]], timeout_s=min(timeout_s, 10.0)
            )
        except SwarmError as error:
            logger.info("initial peer %s did not answer info: %s", peer_id[-8:], error)
            continue
        if info.model_hash == weights_hash:
            return
        seen[info.model_hash] = info.model_name
    if seen:
        theirs = ", ".join(f"{n} ({h[:12]})" for h, n in seen.items())
        raise ModelMismatch(f"the swarm serves {theirs}, but this client loaded {name} ({weights_hash[:12]})")
