"""`swarm-chat`'s HTTP server: the chat page, the OpenAI-compatible API, the status page and /metrics.

aiohttp rather than FastAPI on uvicorn: one small async server that speaks server-sent events natively
(a StreamResponse written chunk by chunk), runs on the uvloop loop the client already uses, and needs no
ASGI stack; the API is a handful of routes whose validation lives in openai_api.py anyway.

Every error leaves through one middleware in OpenAI's error shape; a client that goes away (or presses stop)
cancels its handler, which closes the generation and so the session on every peer of its route.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from client.client import AsyncSwarmClient
from client.routes import SwarmRoutes
from client.web.config import WebConfig
from client.web.errors import APIError, from_exception, invalid
from client.web.limits import GenerationSlots, RateLimiter
from client.web.metrics import CONTENT_TYPE, WebMetrics
from client.web.openai_api import CompletionRequest, Kind, Responder, models_list, parse_request
from client.web.service import Notice, Outcome, Piece, SwarmGenerator
from client.web.status import read_live, status_json
from swarm.dht import SwarmSnapshot
from swarm.errors import SwarmError
from swarm.models.spec import ModelSpec

logger = logging.getLogger(__name__)

STATIC = Path(__file__).parent / "static"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _sse(data: Any) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


class WebServer:
    """The aiohttp application around one AsyncSwarmClient."""

    def __init__(self, config: WebConfig, client: AsyncSwarmClient, spec: ModelSpec) -> None:
        if not isinstance(client.routes, SwarmRoutes):
            raise TypeError("the web server needs a client connected to a swarm (AsyncSwarmClient.create)")
        self.config = config
        self.client = client
        self.routes: SwarmRoutes = client.routes
        self.model_name = spec.name
        self.num_layers = spec.num_layers
        self.models = tuple(dict.fromkeys((spec.name, config.client.model)))  # names a request may use
        self.metrics = WebMetrics()
        self.generator = SwarmGenerator(
            client,
            self.metrics,
            self.peer_names,
            recent=config.recent_requests,
            context_tokens=config.context_tokens,
        )
        self.rate = RateLimiter(config.rate_limit_per_min, config.rate_limit_burst)
        self.slots = GenerationSlots(config.max_concurrent_generations, config.max_queued_generations)
        self.url = ""

    def peer_names(self) -> dict[str, str]:
        snapshot = self.routes._snapshot  # the routes' latest read; no DHT traffic for a name
        return {pid: r.name for pid, r in snapshot.peers.items()} if snapshot else {}

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors], client_max_size=self.config.max_body_bytes)
        app.router.add_get("/", self._page("chat.html"))
        app.router.add_get("/status", self._page("status.html"))
        app.router.add_static("/static/", STATIC)
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.text_completions)
        app.router.add_get("/api/status", self.status)
        app.router.add_get("/metrics", self.render_metrics)
        return app

    # --- middleware ----------------------------------------------------------------------------------------

    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Every error in OpenAI's shape (never a traceback), and every request counted by route and status."""
        route = request.match_info.route.resource
        endpoint = route.canonical if route is not None else "unmatched"
        try:
            response = await handler(request)
        except web.HTTPException as error:  # aiohttp's own: 404, 405, 413 from client_max_size
            response = self._error_response(APIError(error.status, error.reason, _error_type(error.status)))
        except APIError as error:
            response = self._error_response(error)
        except Exception as error:  # a bug or the swarm failing: tell the user plainly, keep serving
            if not isinstance(error, TimeoutError | ConnectionError):
                logger.exception("%s %s failed", request.method, request.path)
            response = self._error_response(from_exception(error))
        self.metrics.requests.labels(endpoint, str(response.status)).inc()
        return response

    def _error_response(self, error: APIError) -> web.Response:
        self.metrics.errors.labels(error.type, error.code or "").inc()
        return web.json_response(error.body(), status=error.status)

    # --- pages and small endpoints -------------------------------------------------------------------------

    def _page(self, name: str) -> Handler:
        async def page(request: web.Request) -> web.StreamResponse:
            return web.FileResponse(STATIC / name, headers={"Cache-Control": "no-cache"})

        return page

    async def list_models(self, request: web.Request) -> web.Response:
        return web.json_response(models_list(self.models))

    async def render_metrics(self, request: web.Request) -> web.Response:
        try:
            snapshot = await self._read_snapshot()  # peers seen; a failed read leaves the last numbers
        except (TimeoutError, OSError, RuntimeError) as error:
            logger.info("directory read for /metrics failed: %r", error)
        else:
            await self._read_peers(snapshot)
        self.metrics.queued.set(self.slots.waiting)
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def _read_peers(self, snapshot: SwarmSnapshot) -> None:
        """Each serving peer's background traffic by cause and its KV cache, as it answers rpc_info now."""
        p2p = getattr(self.client.chain, "p2p", None)
        if p2p is None:
            return
        live = await read_live(p2p, snapshot.peers.values(), self.config.status_timeout_s)
        m = self.metrics
        for gauge in (m.background, m.kv_blocks, m.prefix_tokens, m.prefix_hit_rate):
            gauge.clear()
        for peer_id, info in live.items():
            for cause, sent, received in info.background_bytes:
                m.background.labels(peer_id, cause, "sent").set(sent)
                m.background.labels(peer_id, cause, "received").set(received)
            if info.cache is not None:
                c = info.cache
                for kind, blocks in (
                    ("used", c.used_blocks),
                    ("shared", c.shared_blocks),
                    ("free", c.free_blocks),
                ):
                    m.kv_blocks.labels(peer_id, kind).set(blocks)
                m.prefix_tokens.labels(peer_id, "looked_up").set(c.prefix_tokens_looked_up)
                m.prefix_tokens.labels(peer_id, "shared").set(c.prefix_tokens_shared)
                m.prefix_hit_rate.labels(peer_id).set(c.prefix_hit_rate)

    async def _read_snapshot(self) -> SwarmSnapshot:
        async with asyncio.timeout(self.config.status_timeout_s):
            snapshot = await self.routes.snapshot()
        self.metrics.peers.clear()
        for state in ("loading", "serving", "leaving"):
            self.metrics.peers.labels(state).set(sum(r.state == state for r in snapshot.peers.values()))
        return snapshot

    async def status(self, request: web.Request) -> web.Response:
        snapshot = await self._read_snapshot()
        p2p = getattr(self.client.chain, "p2p", None)
        live = await read_live(p2p, snapshot.peers.values(), self.config.status_timeout_s) if p2p else {}
        body = status_json(snapshot, self.num_layers, self.model_name, live, list(self.generator.recent))
        body["server"] = {
            "url": self.url,
            "models": list(self.models),
            "active_generations": self.slots.running,
            "queued_generations": self.slots.waiting,
            "max_concurrent_generations": self.config.max_concurrent_generations,
            "max_tokens_limit": self.config.max_tokens_limit,
            "default_max_tokens": self.config.default_max_tokens,
        }
        return web.json_response(body)

    # --- the OpenAI API ------------------------------------------------------------------------------------

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, "chat")

    async def text_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, "text")

    async def _complete(self, request: web.Request, kind: Kind) -> web.StreamResponse:
        arrived_at = self.generator.clock()
        self.rate.check(request.remote or "unknown")
        job = parse_request(
            await _read_json(request, self.config.max_body_bytes),
            kind,
            self.models,
            self.config.default_max_tokens,
            self.config.max_tokens_limit,
        )
        ids = self.generator.prompt_ids(job)
        responder = Responder.new(kind, secrets.token_hex(12), job.model)
        deadline = asyncio.get_running_loop().time() + self.config.request_timeout_s
        if job.stream:
            return await self._stream(request, job, ids, responder, arrived_at, deadline)
        async with asyncio.timeout_at(deadline), self.slots.slot():
            text, outcome = await self._collect(job, ids, arrived_at)
        body = responder.whole(text, outcome.finish_reason, outcome.prompt_tokens, outcome.completion_tokens)
        body["swarm"] = _extension(outcome)
        return web.json_response(body)

    async def _collect(
        self, job: CompletionRequest, ids: list[int], arrived_at: float
    ) -> tuple[str, Outcome]:
        text, outcome = [], Outcome()
        async for event in self.generator.run(job, ids, arrived_at):
            if isinstance(event, Piece):
                text.append(event.text)
            elif isinstance(event, Outcome):
                outcome = event
        return "".join(text), outcome

    async def _stream(
        self,
        request: web.Request,
        job: CompletionRequest,
        ids: list[int],
        responder: Responder,
        arrived_at: float,
        deadline: float,
    ) -> web.StreamResponse:
        """Server-sent events: a chunk per piece, the finish chunk (with the route), usage if asked, [DONE].

        Queue overflow or a timeout while queued is still a plain error response (no byte is sent before a
        slot is ours); an error after the first byte goes out as an `error` event, which OpenAI's clients
        raise as an APIError.
        """
        async with asyncio.timeout_at(deadline):
            await self.slots.acquire()
        try:
            response = web.StreamResponse(headers=SSE_HEADERS)
            await response.prepare(request)
            try:
                async with asyncio.timeout_at(deadline):
                    if job.kind == "chat":
                        await response.write(_sse(responder.chunk("", first=True)))
                    async for event in self._stream_events(job, ids, responder, arrived_at):
                        await response.write(event)
            except ConnectionError:
                return response  # the client went away: the generation is closed, nothing to tell
            except Exception as error:
                if not isinstance(error, APIError | TimeoutError | SwarmError):
                    logger.exception("streaming a generation failed")
                api_error = from_exception(error)
                self.metrics.errors.labels(api_error.type, api_error.code or "").inc()
                await response.write(_sse(api_error.body()))
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        finally:
            self.slots.release()

    async def _stream_events(
        self, job: CompletionRequest, ids: list[int], responder: Responder, arrived_at: float
    ) -> AsyncIterator[bytes]:
        async for event in self.generator.run(job, ids, arrived_at):
            if isinstance(event, Piece):
                yield _sse(responder.chunk(event.text))
            elif isinstance(event, Notice):
                # An SSE comment: every OpenAI client skips it; the chat page shows it.
                yield f": notice {event.text}\n\n".encode()
            else:
                final = responder.chunk("", event.finish_reason)
                final["swarm"] = _extension(event)
                yield _sse(final)
                if job.include_usage:
                    yield _sse(responder.usage_chunk(event.prompt_tokens, event.completion_tokens))

    # --- running -------------------------------------------------------------------------------------------

    async def run(self, on_ready: Callable[[str], None] = print) -> None:
        """Serve until cancelled; `on_ready` gets the base URL once the socket listens."""
        runner = web.AppRunner(self.app(), handler_cancellation=True, access_log=None)
        await runner.setup()
        try:
            site = web.TCPSite(runner, self.config.host, self.config.port)
            await site.start()
            host, port = runner.addresses[0][:2]
            self.url = f"http://{host}:{port}/"
            on_ready(self.url)
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()


def _extension(outcome: Outcome) -> dict[str, Any]:
    """FlowSwarm's extra field on the last chunk: which peers served the answer (OpenAI clients ignore it)."""
    return {"route": outcome.route, "failovers": outcome.failovers, "ttft_s": outcome.ttft_s}


def _error_type(status: int) -> str:
    return {404: "not_found_error", 429: "rate_limit_error"}.get(status, "invalid_request_error")


async def _read_json(request: web.Request, max_body_bytes: int) -> Any:
    """The decoded JSON body; 413 past the size limit (checked before reading when the length is declared)."""
    too_big = APIError(413, f"the request body is over {max_body_bytes} bytes", code="request_too_large")
    if request.content_length is not None and request.content_length > max_body_bytes:
        raise too_big
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge as error:
        raise too_big from error
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise invalid(f"the request body is not valid JSON: {error}", code="invalid_json") from error


async def serve(config: WebConfig, on_ready: Callable[[str], None] = print) -> None:
    """Connect to the swarm, then serve until cancelled; the client leaves the swarm on the way out."""
    from swarm.models.loading import resolve_model

    source = await asyncio.to_thread(resolve_model, config.client.model)
    started = time.perf_counter()
    client = await AsyncSwarmClient.create(config.client.initial_peers, config.client.model, config.client)
    logger.info("connected to the swarm in %.1f s", time.perf_counter() - started)
    try:
        await WebServer(config, client, source.spec).run(on_ready)
    finally:
        await client.close()
