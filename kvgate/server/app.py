"""The OpenAI-compatible HTTP API.

Order of a generating request: read the body (413 past the limit) -> parse and validate (400 naming
the field) -> tokenize -> `engine.submit` (400 never-fits, 503 queue full) -> await admission while
watching for a disconnect (429 after the bounded wait) -> only then send headers (200 JSON or SSE) ->
stream. A client that leaves at any point cancels its request in the engine.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvgate.request import Admitted, Finished, GenerationRequest, Refusal, Token
from kvgate.sampling import SamplingError, SamplingParams
from kvgate.server import protocol as P
from kvgate.server.console import LiveStats, install_console  # issue 15: console
from kvgate.server.errors import APIError, from_refusal, invalid
from kvgate.server.metrics import Metrics
from kvgate.server.openapi import install_openapi

log = logging.getLogger("kvgate.server")


@dataclass
class ServerSettings:
    model_name: str = "kvgate-model"
    api_key: str | None = None
    max_body_bytes: int = 4 << 20
    default_temperature: float = 1.0


class ClientGone(Exception):
    pass


def create_app(settings: ServerSettings, engine=None) -> FastAPI:
    app = FastAPI(title="kvgate", version="0.1.0", docs_url=None, redoc_url=None)
    app.state.engine = engine
    app.state.status = "ready" if engine is not None else "loading"
    app.state.load_error = None
    app.state.settings = settings
    metrics = Metrics(lambda: app.state.engine)
    app.state.metrics = metrics
    install_openapi(app)
    app.state.live = LiveStats()  # issue 15: console
    install_console(app)  # issue 15: console

    # ---- cross-cutting ----------------------------------------------------------------------
    app.add_middleware(AuthAndCount, settings=settings, metrics=metrics)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            return APIError(404, f"no route {request.method} {request.url.path}", "not_found").response()
        if exc.status_code == 405:  # keep Starlette's Allow header (RFC 9110 requires it on a 405)
            err = APIError(
                405, f"method {request.method} is not allowed on {request.url.path}", "method_not_allowed"
            )
            return err.response(headers=exc.headers)
        return APIError(exc.status_code, str(exc.detail), "http_error").response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return APIError(
            500, "internal server error; the details are in the server log", "internal_error"
        ).response()

    def ready_engine():
        eng = app.state.engine
        err = None
        if app.state.status == "shutting_down":
            err = APIError(
                503,
                "the server is shutting down; retry against another replica",
                "shutting_down",
                retry_after=5,
            )
        elif eng is None:
            err = APIError(503, "the model is still loading; retry shortly", "not_ready", retry_after=5)
        elif not eng.alive:
            err = APIError(
                503,
                "the engine is not running (see /health); requests cannot be served",
                "engine_unavailable",
                retry_after=5,
            )
        elif (stall := eng.stalled()) is not None:
            err = APIError(503, f"the engine is not answering: {stall}", "engine_unavailable", retry_after=5)
        if err is not None:
            metrics.rejections.labels(err.code).inc()  # a refusal like any other: counted once
            app.state.live.record_refusal(err.code, err.retry_after)  # issue 15: console
            raise err
        return eng

    # ---- plain routes -----------------------------------------------------------------------
    @app.get("/health")
    async def health():
        eng = app.state.engine
        if app.state.status == "shutting_down":
            return JSONResponse({"status": "shutting_down"}, status_code=503, headers={"Retry-After": "5"})
        if eng is None:
            body = {
                "status": "loading" if app.state.load_error is None else "failed",
                "reason": app.state.load_error,
            }
            return JSONResponse(body, status_code=503, headers={"Retry-After": "5"})
        if not eng.alive:
            return JSONResponse({"status": "dead", "reason": "the engine worker stopped"}, status_code=503)
        stall = eng.stalled()
        if stall is not None:
            return JSONResponse({"status": "stalled", "reason": stall}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        eng = app.state.engine
        card = {"id": settings.model_name, "object": "model", "created": 0, "owned_by": "kvgate"}
        if eng is not None:
            card["max_model_len"] = eng.max_model_len
        return {"object": "list", "data": [card]}

    @app.get("/v1/resources")
    async def resources():
        eng = ready_engine()
        plan = eng.plan
        snap = eng.snapshot()
        return {
            "plan": plan.to_dict(),
            "ledger": {
                "limit_bytes": eng.ledger.limit,
                "reserved_bytes": eng.ledger.reserved,
                "reserved_by_role": eng.ledger.by_role(),
                "reservations": eng.ledger.snapshot(),
            },
            "kv": {
                "blocks_total": snap.kv_blocks_total,
                "blocks_free": snap.kv_blocks_free,
                "blocks_referenced": snap.kv_blocks_held,
                "blocks_cached": 0,
                "blocks_peak": snap.counters.kv_blocks_peak,
                "block_size": plan.block_size,
                "bytes_per_token": plan.kv_bytes_per_token,
            },
            "scheduler": {
                "running": snap.running,
                "waiting": snap.waiting,
                "max_seqs": plan.limits.max_seqs,
                "prefill_chunk": plan.limits.prefill_chunk,
                "max_model_len": eng.max_model_len,
            },
            "live": app.state.live.summary(),  # issue 15: console
        }

    @app.post("/v1/tokenize")
    async def tokenize(request: Request):
        eng = ready_engine()
        req = P.parse(P.TokenizeRequest, await read_json(request, settings.max_body_bytes))
        check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise invalid("send exactly one of 'prompt' or 'messages'", param="prompt")
        if req.messages is not None:
            ids = eng.tokenizer.chat_ids(P.chat_messages(P.ChatCompletionRequest(messages=req.messages)))
        else:
            ids = eng.tokenizer.encode(req.prompt, add_bos=None if req.add_special_tokens else False)
        return {"tokens": ids, "count": len(ids), "max_model_len": eng.max_model_len}

    @app.post("/v1/detokenize")
    async def detokenize(request: Request):
        eng = ready_engine()
        req = P.parse(P.DetokenizeRequest, await read_json(request, settings.max_body_bytes))
        check_model(req.model)
        check_ids(eng, req.tokens, "tokens")
        return {"prompt": eng.tokenizer.decode(req.tokens, skip_special_tokens=False)}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, P.ChatCompletionRequest)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, P.CompletionRequest)

    # ---- generation -------------------------------------------------------------------------
    def check_model(name: str | None) -> None:
        if name not in (None, "", settings.model_name, "default"):
            raise APIError(
                404,
                f"model {name!r} is not served here; this server serves {settings.model_name!r} (see /v1/models)",
                "model_not_found",
                param="model",
            )

    async def generate(request: Request, cls):
        eng = ready_engine()
        req = P.parse(cls, await read_json(request, settings.max_body_bytes))
        P.check_common(req)
        if isinstance(req, P.CompletionRequest):
            P.check_completion(req)
        check_model(req.model)
        kind = P.request_kind(req)
        prompts = prompt_ids(eng, req)
        sampling = SamplingParams(
            temperature=settings.default_temperature if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=req.top_k or 0,
            min_p=req.min_p or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            seed=req.seed,
        )
        try:
            sampling.validate()
        except SamplingError as exc:
            raise invalid(str(exc), param=exc.param) from None
        if req.stop_token_ids:
            check_ids(eng, req.stop_token_ids, "stop_token_ids")
        max_tokens = P.max_tokens_of(req)
        gens = [
            GenerationRequest(
                ids, sampling, max_tokens, P.stop_list(req), list(req.stop_token_ids or []), req.ignore_eos
            )
            for ids in prompts
        ]
        handles = []
        try:
            for g in gens:
                handles.append(eng.submit(g))
        except Refusal as r:
            for h in handles:
                h.cancel()
            metrics.rejections.labels(r.code).inc()
            app.state.live.record_refusal(r.code, r.retry_after)  # issue 15: console
            return from_refusal(r).response()
        try:
            admitted = await until_disconnect(request, admit_all(handles), handles)
        except Refusal as r:
            if (
                r.status == 499
            ):  # cancelled while queued, and not by this client (that is ClientGone): a shutdown
                r = Refusal(
                    "shutting_down",
                    "the server is shutting down and did not admit this request; retry against another replica",
                    503,
                    retry_after=5,
                )
            metrics.rejections.labels(r.code).inc()
            app.state.live.record_refusal(r.code, r.retry_after)  # issue 15: console
            return from_refusal(r).response()
        except ClientGone:
            return Response(status_code=499)
        headers = {}
        caps = [a.budget_cap for a in admitted if a.budget_cap is not None]
        if caps:
            headers["X-KVGate-Budget-Cap"] = caps[0].header()
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            stream = sse_stream(kind, rid, created, handles, admitted, include_usage)
            headers.update({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            return StreamingResponse(stream, media_type="text/event-stream", headers=headers)
        try:
            results = await until_disconnect(request, finish_all(handles), handles)
        except ClientGone:
            return Response(status_code=499)
        for res in results:
            metrics.observe_result(res)
            app.state.live.observe_result(res)  # issue 15: console
        failed = [r for r in results if r.finish_reason == "error"]
        if failed:
            log.error("generation failed: %s", failed[0].error)
            return APIError(
                500, "generation failed inside the engine; the details are in the server log", "engine_error"
            ).response()
        return JSONResponse(completion_body(kind, rid, created, results), headers=headers)

    def prompt_ids(eng, req) -> list[list[int]]:
        tok = eng.tokenizer
        if isinstance(req, P.ChatCompletionRequest):
            try:
                return [tok.chat_ids(P.chat_messages(req))]
            except ValueError as exc:
                raise invalid(str(exc), param="messages") from None
        p = req.prompt
        if isinstance(p, str):
            out = [tok.encode(p)]
        elif not p:
            raise invalid("prompt must not be empty", param="prompt")
        elif all(isinstance(x, str) for x in p):
            out = [tok.encode(x) for x in p]
        elif all(isinstance(x, int) for x in p):
            check_ids(eng, p, "prompt")
            out = [list(p)]
        else:
            for ids in p:
                check_ids(eng, ids, "prompt")
            out = [list(x) for x in p]
        if any(not ids for ids in out):  # refused here, not by the engine: an empty prompt is bad input
            raise invalid("prompt must not be empty: send at least one token of prompt", param="prompt")
        return out

    def check_ids(eng, ids, param: str) -> None:
        vocab = eng.tokenizer.vocab_size
        for t in ids:
            if not 0 <= t < vocab:
                raise invalid(
                    f"token id {t} in '{param}' is outside the vocabulary [0, {vocab})", param=param
                )

    async def sse_stream(kind, rid, created, handles, admitted, include_usage):
        finished: dict[int, object] = {}
        base = {
            "id": rid,
            "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
            "created": created,
            "model": settings.model_name,
        }

        def chunk(i, text=None, finish=None, role=False):
            if kind == "chat":
                delta = {}
                if role:
                    delta["role"] = "assistant"
                if text is not None:
                    delta["content"] = text
                choice = {"index": i, "delta": delta, "finish_reason": finish}
            else:
                choice = {"index": i, "text": text or "", "finish_reason": finish, "logprobs": None}
            return "data: " + json.dumps({**base, "choices": [choice]}, ensure_ascii=False) + "\n\n"

        try:
            if kind == "chat":
                for i in range(len(handles)):
                    yield chunk(i, "", role=True)
            async for i, ev in merged_events(handles):
                if isinstance(ev, Token):
                    if ev.text:
                        yield chunk(i, ev.text)
                elif isinstance(ev, Finished):
                    finished[i] = ev.result
                    metrics.observe_result(ev.result)
                    app.state.live.observe_result(ev.result)  # issue 15: console
                    if ev.tail:
                        yield chunk(i, ev.tail)
                    if ev.result.finish_reason == "error":
                        log.error("generation failed mid-stream: %s", ev.result.error)
                        err = APIError(
                            500,
                            "generation failed inside the engine; the details are in the server log",
                            "engine_error",
                        )
                        yield "data: " + json.dumps(err.body()) + "\n\n"
                        for h in handles:
                            h.cancel()
                        yield "data: [DONE]\n\n"
                        return
                    yield chunk(i, None if kind == "chat" else "", finish=ev.result.finish_reason)
            if include_usage:
                results = [finished[i] for i in sorted(finished)]
                yield (
                    "data: " + json.dumps({**base, "choices": [], "usage": usage(results, admitted)}) + "\n\n"
                )
            yield "data: [DONE]\n\n"
        finally:
            if len(finished) < len(handles):  # the client left (or the stream broke): stop the work
                for h in handles:
                    h.cancel()

    def completion_body(kind, rid, created, results) -> dict:
        if kind == "chat":
            choices = [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": r.text},
                    "finish_reason": r.finish_reason,
                    "logprobs": None,
                }
                for i, r in enumerate(results)
            ]
            obj = "chat.completion"
        else:
            choices = [
                {"index": i, "text": r.text, "finish_reason": r.finish_reason, "logprobs": None}
                for i, r in enumerate(results)
            ]
            obj = "text_completion"
        return {
            "id": rid,
            "object": obj,
            "created": created,
            "model": settings.model_name,
            "choices": choices,
            "usage": usage(results, None),
        }

    return app


_ENDPOINTS = {
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/models",
    "/v1/tokenize",
    "/v1/detokenize",
    "/v1/resources",
    "/health",
    "/metrics",
}


def usage(results, admitted) -> dict:
    prompt = sum(r.prompt_tokens for r in results)
    completion = sum(r.completion_tokens for r in results)
    cap = next((r.budget_cap for r in results if r.budget_cap is not None), None)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "budget_cap": None
        if cap is None
        else {
            "requested_max_tokens": cap.requested_max_tokens,
            "admitted_max_tokens": cap.admitted_max_tokens,
            "reason": cap.reason,
        },
    }


class AuthAndCount:
    """Pure ASGI (no BaseHTTPMiddleware, which would interfere with streaming and disconnects):
    API-key check on /v1/* with a constant-time compare, and requests_total{endpoint,status}."""

    def __init__(self, app, settings: ServerSettings, metrics: Metrics):
        self.app, self.settings, self.metrics = app, settings, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        endpoint = path if path in _ENDPOINTS else "other"
        key = self.settings.api_key
        if key and path.startswith("/v1/"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            token = given[7:] if given[:7].lower() == b"bearer " else b""
            if not hmac.compare_digest(token, key.encode()):
                self.metrics.requests.labels(endpoint, "401").inc()
                err = APIError(
                    401, "missing or wrong API key: send 'Authorization: Bearer <key>'", "invalid_api_key"
                )
                return await err.response()(scope, receive, send)
        status = {"code": 499}

        async def send_and_note(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            self.metrics.requests.labels(endpoint, str(status["code"])).inc()


async def read_json(request: Request, limit: int):
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(
            413, f"request body is {int(declared)} bytes; the limit is {limit} bytes", "body_too_large"
        )
    body = bytearray()
    async for piece in request.stream():
        body += piece
        if len(body) > limit:
            raise APIError(413, f"request body exceeds the limit of {limit} bytes", "body_too_large")
    try:
        text = bytes(body).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise invalid(
            f"request body is not valid UTF-8 (byte {exc.start})", code="invalid_encoding"
        ) from None
    try:
        data = json.loads(text, parse_constant=_no_constants)
    except json.JSONDecodeError as exc:
        raise invalid(
            f"request body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}",
            code="invalid_json",
        ) from None
    except RecursionError:  # e.g. 100k nested '[': the decoder's recursion limit, not a server fault
        raise invalid("request body is nested too deeply to be a request", code="invalid_json") from None
    except ValueError as exc:
        raise invalid(str(exc), code="invalid_json") from None
    where = _unpaired_surrogate(data)
    if where is not None:  # "\ud800" is valid JSON but not Unicode: the tokenizer would raise on it
        raise invalid(
            f"the string at '{where or 'body'}' contains an unpaired UTF-16 surrogate escape, which is not valid Unicode",
            param=where or None,
            code="invalid_encoding",
        )
    return data


def _no_constants(name: str):
    raise ValueError(f"request body contains {name}, which is not valid JSON")


def _unpaired_surrogate(data) -> str | None:
    """The dotted path of the first string (value or key) holding a lone surrogate, or None."""
    stack = [("", data)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, str):
            if not v.isascii():
                try:
                    v.encode("utf-8")
                except UnicodeEncodeError:
                    return path
        elif isinstance(v, dict):
            for k, x in v.items():
                p = f"{path}.{k}" if path else str(k)
                if not k.isascii():
                    try:
                        k.encode("utf-8")
                    except UnicodeEncodeError:
                        return p
                stack.append((p, x))
        elif isinstance(v, list):
            stack.extend((f"{path}.{i}" if path else str(i), x) for i, x in enumerate(v))
    return None


async def admit_all(handles) -> list[Admitted]:
    outcomes = await asyncio.gather(*(h.await_admitted() for h in handles), return_exceptions=True)
    refusals = [o for o in outcomes if isinstance(o, BaseException)]
    if refusals:
        for h in handles:
            h.cancel()
        raise refusals[0]
    return list(outcomes)


async def finish_all(handles):
    async def one(h):
        async for ev in h.aevents():
            if isinstance(ev, Finished):
                return ev.result

    return await asyncio.gather(*(one(h) for h in handles))


async def merged_events(handles):
    if len(handles) == 1:
        async for ev in handles[0].aevents():
            yield 0, ev
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i, h):
        async for ev in h.aevents():
            await q.put((i, ev))

    tasks = [asyncio.ensure_future(pump(i, h)) for i, h in enumerate(handles)]
    try:
        done = 0
        while done < len(handles):
            i, ev = await q.get()
            yield i, ev
            if isinstance(ev, Finished):
                done += 1
    finally:
        for t in tasks:
            t.cancel()


async def until_disconnect(request: Request, coro, handles):
    """Await `coro`; if the client disconnects first, cancel the requests and raise ClientGone."""
    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(_watch_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        for h in handles:
            h.cancel()
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    for h in handles:
        h.cancel()
    task.cancel()
    raise ClientGone()


async def _watch_disconnect(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.1)
