"""The aiohttp application: routes, middlewares, streaming, cancellation and drain.

A request's life: the access middleware times it and writes one log line; the errors
middleware turns any refusal into OpenAI's error shape (a 500 only for the daemon's own
bugs); the gate answers 503 while loading or draining and 401 without the key; the
body middleware refuses non-JSON (415) and oversized bodies (413). A completion handler
submits one lane and relays its events; if the client goes away (aiohttp cancels the
handler, or a write fails) the lane is cancelled at the engine's next round.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from contextvars import ContextVar
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from lanes.client import EngineClient, EngineUnavailable
from lanes.engine import QueueFull, RequestError
from lanes.lane import FinishReason

from .metrics import Metrics, RequestTracker
from .openai import DONE, KEEPALIVE, Front, Job, Reply, error_event
from .schemas import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorBody,
    ErrorResponse,
    ModelCard,
    ModelList,
    StatusResponse,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
    bad_request,
    decode,
    encode,
)

log = logging.getLogger("laneserve")
access_log = logging.getLogger("laneserve.access")

# Open without the API key, and during loading and draining: probes and scrapes.
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large", 415: "unsupported_media_type"}


@dataclass(frozen=True)
class ServerConfig:
    model_name: str
    api_key: str | None = None
    max_body_bytes: int = 2 << 20
    keepalive_seconds: float = 5.0  # SSE comment interval while a request waits for its first token
    retry_after_seconds: int = 1


@dataclass
class Serving:
    """What exists once the model is loaded."""

    client: EngineClient
    front: Front
    metrics: Metrics


def make_serving(client: EngineClient, tokenizer, vocab_size: int, model_name: str, max_model_len: int,
                 sampling_defaults: dict) -> Serving:
    return Serving(client, Front(tokenizer, model_name, max_model_len, vocab_size, sampling_defaults),
                   Metrics(model_name, max_model_len, client.stats))


@dataclass
class Access:
    """What the access line reports, filled in by the handler."""

    request_id: str = "-"
    completion: object = None
    started: float = field(default_factory=time.monotonic)


# The access record of the request this task is answering (set by the access middleware).
current_access: ContextVar[Access] = ContextVar("current_access")


def package_version() -> str:
    try:
        return version("laneserve")
    except PackageNotFoundError:
        return "unknown"


def json_response(body, status: int = 200, headers: dict | None = None) -> web.Response:
    return web.Response(body=encode(body), status=status, content_type="application/json", headers=headers)


def error_response(e: ApiError) -> web.Response:
    return json_response(e.body, e.status, e.headers)


class Server:
    def __init__(self, config: ServerConfig):
        self.config = config
        self.serving: Serving | None = None
        self.draining = False
        self.started = int(time.time())
        self._active = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._runner: web.AppRunner | None = None
        self.app = self._build_app()

    def attach(self, serving: Serving) -> None:
        self.serving = serving

    @property
    def ready(self) -> bool:
        return self.serving is not None and not self.draining and self.serving.client.ready \
            and self.serving.client.health().ok

    # ---- lifecycle -----------------------------------------------------------------------

    async def listen(self, host: str, port: int) -> tuple[str, int]:
        """Bind and serve; returns the bound address (port 0 picks a free one)."""
        self._runner = web.AppRunner(self.app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        bound = self._runner.addresses[0]
        return bound[0], bound[1]

    async def drain(self, timeout: float) -> None:
        """Stop admitting (ready and new requests turn 503), let running streams finish
        for `timeout` seconds, end the rest with an error event, then close."""
        self.draining = True
        if self.serving is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.serving.client.shutdown, timeout)
        # Every lane has had its final event; give the handlers a moment to write it.
        try:
            await asyncio.wait_for(self._idle.wait(), timeout=5.0)
        except TimeoutError:
            log.warning("%d requests were still being answered at shutdown", self._active)
        await self.close()

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # ---- the application -----------------------------------------------------------------

    def _build_app(self) -> web.Application:
        app = web.Application(
            middlewares=[self._access, self._errors, self._gate, self._body],
            client_max_size=self.config.max_body_bytes,
        )
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/version", self.version)
        app.router.add_get("/health", self.health)
        app.router.add_get("/ready", self.ready_probe)
        app.router.add_get("/metrics", self.metrics)
        return app

    @web.middleware
    async def _access(self, request: web.Request, handler):
        record = Access()
        current_access.set(record)
        self._active += 1
        self._idle.clear()
        status = 499  # nginx's "client closed the request", if the handler is cancelled
        try:
            response = await handler(request)
            status = response.status
            return response
        finally:
            self._active -= 1
            if self._active == 0:
                self._idle.set()
            self._log_access(request, record, status)

    def _log_access(self, request: web.Request, record: Access, status: int) -> None:
        seconds = time.monotonic() - record.started
        done = record.completion
        if done is None:
            access_log.info("%s %s %s %d %.3fs", record.request_id, request.method, request.path, status, seconds)
            return
        t, generated = done.timings, len(done.token_ids)
        rate = generated / t.decode_seconds if t.decode_seconds > 0 else 0.0
        access_log.info(
            "%s %s %s %d %.3fs prompt=%d completion=%d ttft=%.3fs %.1f tok/s cached=%d drafts accepted=%d/%d "
            "finish=%s",
            record.request_id, request.method, request.path, status, seconds, done.prompt_tokens, generated,
            t.ttft_seconds, rate, done.cached_tokens, done.draft.accepted, done.draft.proposed, done.finish_reason.value,
        )

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        try:
            return await handler(request)
        except ApiError as e:
            return error_response(e)
        except web.HTTPException as e:  # the router's 404 and 405, aiohttp's own 413
            if e.status < 400:
                raise
            headers = {k: v for k, v in e.headers.items() if k.lower() in ("allow",)}
            message = f"{e.reason}: {request.method} {request.path}" if e.status in (404, 405) else e.text or e.reason
            body = ErrorResponse(ErrorBody(message, "invalid_request_error", None, HTTP_CODES.get(e.status)))
            return json_response(body, e.status, headers)
        except Exception:
            log.exception("internal error answering %s %s", request.method, request.path)
            return json_response(ErrorResponse(ErrorBody("internal server error", "server_error", None, None)), 500)

    @web.middleware
    async def _gate(self, request: web.Request, handler):
        if request.path in OPEN_PATHS:
            return await handler(request)
        key = self.config.api_key
        if key is not None:
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode("utf-8", "surrogateescape"), f"Bearer {key}".encode()):
                raise ApiError(401, "a valid API key is needed: send `Authorization: Bearer <key>`",
                               code="invalid_api_key")
        if self.draining:
            raise ApiError(503, "the server is shutting down", type="service_unavailable", code="draining")
        if self.serving is None:
            raise ApiError(503, "the model is loading", type="service_unavailable", code="loading")
        return await handler(request)

    @web.middleware
    async def _body(self, request: web.Request, handler):
        if request.method == "POST" and request.match_info.http_exception is None:
            if request.content_type != "application/json" and not request.content_type.endswith("+json"):
                raise ApiError(415, f"send a JSON body (Content-Type: application/json), got {request.content_type!r}",
                               code="unsupported_media_type")
            if request.content_length is not None and request.content_length > self.config.max_body_bytes:
                raise ApiError(413, f"the body is {request.content_length} bytes; the limit is "
                               f"{self.config.max_body_bytes}", code="body_too_large")
        return await handler(request)

    # ---- completions -----------------------------------------------------------------------

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        serving = self.serving
        job = serving.front.chat_job(decode(await request.read(), ChatCompletionRequest))
        return await self._run(request, serving, job)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        serving = self.serving
        job = serving.front.completion_job(decode(await request.read(), CompletionRequest))
        return await self._run(request, serving, job)

    async def _run(self, request: web.Request, serving: Serving, job: Job) -> web.StreamResponse:
        try:
            handle = serving.client.submit(job.request)
        except RequestError as e:
            raise bad_request(str(e)) from None
        except QueueFull as e:
            raise ApiError(429, str(e), type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(self.config.retry_after_seconds)}) from None
        except EngineUnavailable as e:
            raise ApiError(503, str(e), type="service_unavailable", code="engine_unavailable") from None
        record = current_access.get()
        record.request_id = job.request.id
        tracker = serving.metrics.tracker()
        reply = serving.front.reply(job)
        try:
            if job.stream:
                response = await self._stream(request, handle, reply, tracker)
            else:
                response = await self._respond(handle, reply, tracker)
        except asyncio.CancelledError:  # aiohttp cancels the handler when its client goes away
            serving.metrics.client_disconnected.inc()
            raise
        finally:
            record.completion = tracker.completion
            if tracker.completion is None:  # the reply was not delivered: free the lane at the next round
                handle.cancel()
        if tracker.completion is None:  # a stream whose client went away mid-write
            serving.metrics.client_disconnected.inc()
        return response

    async def _respond(self, handle, reply: Reply, tracker: RequestTracker) -> web.Response:
        entries = []
        async for event in handle:
            tracker.observe(event)
            if event.logprobs:
                entries += event.logprobs
        done = tracker.completion
        if done.finish_reason in (FinishReason.ERROR, FinishReason.CANCELLED):
            if self.draining:
                raise ApiError(503, done.error or "the server is shutting down", type="service_unavailable",
                               code="draining")
            raise ApiError(500, done.error or "the engine failed this request", type="server_error",
                           code="engine_error")
        return json_response(reply.response(done, entries))

    async def _stream(self, request: web.Request, handle, reply: Reply, tracker: RequestTracker) -> web.StreamResponse:
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(request)
        keepalive = None
        try:
            await response.write(reply.opening())
            keepalive = asyncio.create_task(self._keepalive(response))
            async for event in handle:
                if keepalive is not None:  # the prompt has been read
                    keepalive.cancel()
                    await asyncio.wait([keepalive])
                    keepalive = None
                tracker.observe(event)
                if event.finish_reason in (FinishReason.ERROR, FinishReason.CANCELLED):
                    await response.write(error_event(event.error or "the engine ended this request"))
                    break
                await response.write(reply.chunk(event))
            if reply.job.include_usage and tracker.completion is not None:
                await response.write(reply.usage_chunk(tracker.completion))
            await response.write(DONE)
            await response.write_eof()
        except ConnectionResetError:  # the client went away mid-write; `_run` cancels the lane
            pass
        finally:
            if keepalive is not None:
                keepalive.cancel()
        return response

    async def _keepalive(self, response: web.StreamResponse) -> None:
        while True:
            await asyncio.sleep(self.config.keepalive_seconds)
            await response.write(KEEPALIVE)

    # ---- the rest ----------------------------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        front = self.serving.front
        return json_response(ModelList([ModelCard(front.model_name, self.started, front.max_model_len)]))

    async def tokenize(self, request: web.Request) -> web.Response:
        front = self.serving.front
        body = decode(await request.read(), TokenizeRequest)
        front.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("send either prompt or messages", param="prompt")
        if body.messages is not None:
            tokens = front.chat_prompt(body.messages)
        else:
            tokens = front.encode(body.prompt, "prompt", add_special_tokens=body.add_special_tokens)
        return json_response(TokenizeResponse(tokens, len(tokens), front.max_model_len))

    async def detokenize(self, request: web.Request) -> web.Response:
        front = self.serving.front
        body = decode(await request.read(), DetokenizeRequest)
        front.check_model(body.model)
        front.check_token_ids(body.tokens, "tokens")
        return json_response(DetokenizeResponse(front.tokenizer.decode(body.tokens)))

    async def version(self, request: web.Request) -> web.Response:
        return json_response(VersionResponse(package_version()))

    async def health(self, request: web.Request) -> web.Response:
        """200 while the engine thread beats; 503 when it is dead or stalled (or not yet up)."""
        if self.serving is None:
            return json_response(StatusResponse("loading"), 503)
        health = self.serving.client.health()
        status = "ok" if health.ok else "dead" if not health.alive else "stalled"
        body = StatusResponse(status, round(health.seconds_since_beat, 3))
        if health.error:
            body.error = health.error
        return json_response(body, 200 if health.ok else 503)

    async def ready_probe(self, request: web.Request) -> web.Response:
        if self.ready:
            return json_response(StatusResponse("ready"))
        status = "draining" if self.draining else "loading" if self.serving is None or not self.serving.client.ready \
            else "unhealthy"
        return json_response(StatusResponse(status), 503)

    async def metrics(self, request: web.Request) -> web.Response:
        body = self.serving.metrics.render() if self.serving is not None else b""
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
