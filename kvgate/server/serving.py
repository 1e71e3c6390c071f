"""One generating request, from body to response, with admission decided before any header.

    read the body (413 past the limit, on the loop)
    -> prepare off the loop: parse, validate, template, tokenize (400 naming the field)
    -> engine.submit per prompt, off the loop too (400 invalid or never fits, 503 closed or queue
       full, 429 TTFT budget)
    -> await every admission, watching for a disconnect (429 after the bounded wait)
    -> only then headers: 200 JSON, or SSE

A refusal of any prompt of a multi-prompt request cancels the prompts already submitted at once, so
none of them runs on with no one to read it. A client that leaves at any point cancels its requests.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kvgate.core.admission import shutting_down_refusal
from kvgate.request import Admitted, Finished, Refusal, Token
from kvgate.server import request_log
from kvgate.server.auth import REQUEST_ID
from kvgate.server.bodies import read_body
from kvgate.server.context import ready_engine, refused
from kvgate.server.errors import APIError, from_refusal
from kvgate.server.held import hold
from kvgate.server.logprob_body import choice_writer, logprob_response
from kvgate.server.logprobs import decorate_body
from kvgate.server.mistral_tools import parser_for
from kvgate.server.prepare import prepare_generation, submit_all
from kvgate.server.responses import ChunkMaker, completion_body, named_stop_ids, usage
from kvgate.server.sse import ENGINE_ERROR, HandledStream, failure_error, observe_after_cancel, sse_stream
from kvgate.server.stream_shape import StreamShaper
from kvgate.server.tool_parser import model_ended, read_calls
from kvgate.server.vllm_extras import add_token_ids, logprob_names

log = logging.getLogger("kvgate.server")


class ClientGone(Exception):
    pass


async def generate(
    request: Request, cls, raw: bytes | None = None, whole: bool = False, hold=None, prompt_ids: str = "all"
) -> Response:
    """`raw`: the body, when the caller has read (and rewritten) it; `whole`: the caller reads a
    non-streamed answer as one JSON body and builds its own from it (both: `/v1/responses`), holding
    `hold(k)` bytes a position of logprobs while it does (default `dict_hold_bytes`); `prompt_ids`:
    which choices of a text completion carry return_token_ids' prompt ids ("all", "first", "none")."""
    state = request.app.state
    settings = state.settings
    eng = ready_engine(state)
    if raw is None:
        raw = await read_body(request, settings.max_body_bytes)
    prepared = await asyncio.to_thread(prepare_generation, raw, cls, eng, settings, whole, hold)
    prepared.prompt_ids_out = prompt_ids
    try:
        handles = await submitted(eng, prepared.generations, prepared.candidates)
    except Refusal as r:
        refused(state, r.code, r.retry_after)
        return from_refusal(r, prepared.field_names).response()
    try:
        admitted = await until_disconnect(request, admit_all(handles), handles)
    except Refusal as r:
        if r.status == 499:  # cancelled while queued, and not by this client (that is ClientGone)
            r = shutting_down_refusal()
        refused(state, r.code, r.retry_after)
        return from_refusal(r, prepared.field_names).response()
    except ClientGone:
        return Response(status_code=499)
    headers = {}
    caps = [a.budget_cap for a in admitted if a.budget_cap is not None]
    if caps:
        headers["X-KVGate-Budget-Cap"] = caps[0].header()
    kind = prepared.kind
    rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
    created = int(time.time())

    logged = REQUEST_ID.get()

    def on_result(res) -> None:
        state.metrics.observe_result(res)
        state.live.observe_result(res)
        request_log.outcome(settings, logged, res)

    if prepared.stream:
        chunks = ChunkMaker(kind, rid, created, settings.model_name, prepared.n)
        shaper = StreamShaper(chunks, prepared, logprob_names(prepared, eng.tokenizer), handles)
        stream = sse_stream(chunks, handles, prepared.include_usage, on_result, shaper)
        headers.update({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return HandledStream(stream, handles, on_result, headers=headers)
    try:
        token_logprobs: list[list] = [[] for _ in handles]
        think = prepared.reasoning  # a thinking model's reasoning tokens are counted as they come
        counters = [think.splitter() for _ in handles] if think is not None else None
        results = await until_disconnect(request, finish_all(handles, token_logprobs, counters), handles)
    except ClientGone:
        observe_after_cancel(handles, on_result)
        return Response(status_code=499)
    except asyncio.CancelledError:  # the server cancelled this handler (Ray Serve does, when its client
        observe_after_cancel(handles, on_result)  # leaves): the choices were cancelled; count them
        raise
    for res in results:
        on_result(res)
    failed = [i for i, r in enumerate(results) if r.finish_reason == "error"]
    if failed:
        log.error("request %s: generation failed: %s", REQUEST_ID.get(), results[failed[0]].error)
        return failure_error(results[failed[0]], handles[failed[0]].request).response()
    if prepared.prompt_only:  # echo with max_tokens=0: the one token the engine sampled is left out
        results = [prompt_only(r) for r in results]
        token_logprobs = [[] for _ in results]
    every = results
    # a prompt's scores come with its first choice (the others share its prompt positions)
    scores = (
        [r.prompt_logprobs for r in every[:: prepared.candidates]]
        if prepared.features.scores_prompt
        else None
    )
    if scores is not None and any(
        len(sc or ()) != len(g.prompt_ids) - 1 for sc, g in zip(scores, prepared.generations, strict=True)
    ):  # a prompt scored in part (its request cut short): no numbers rather than wrong ones
        log.error("request %s: a scored prompt came back with a part of its scores", REQUEST_ID.get())
        return APIError(500, ENGINE_ERROR, "engine_error").response()
    if prepared.candidates > prepared.n:
        results, token_logprobs = best_of(results, token_logprobs, prepared.candidates, prepared.n)
    stop_ids = named_stop_ids(prepared.request, eng.tokenizer)
    body = completion_body(kind, rid, created, settings.model_name, results, prepared.n, stop_ids)
    spent = sum(c.tokens for c in counters) if counters is not None else None
    body["usage"] = usage(every, prepared.candidates, spent)  # every candidate generated counts
    for choice, res in zip(body["choices"], results, strict=True):
        reasoning = think.take(choice) if think is not None else None  # tools read the content alone
        if prepared.features.tools is not None:
            read_calls(choice, model_ended(res), parser=parser_for(prepared.features.tools))
        if think is not None:
            think.put(choice, reasoning)
    if prepared.request.return_token_ids:
        add_token_ids(body, prepared, results)
    tok = logprob_names(prepared, eng.tokenizer)
    if prepared.features.logprobs is None or whole:
        await asyncio.to_thread(decorate_body, body, prepared, tok, token_logprobs, scores)
        return JSONResponse(body, headers=headers)
    writers = {}  # each choice's logprobs, written while the body is sent (kvgate.server.logprob_body)

    def defer(i, choice, lps, prefix):
        writers[i] = choice_writer(prepared, tok, i, choice, lps, scores, prefix)

    await asyncio.to_thread(decorate_body, body, prepared, tok, token_logprobs, scores, defer)
    return logprob_response(body, writers, headers)


def prompt_only(res):
    """A result as echo with max_tokens=0 reports it: the prompt, no output, finish_reason length."""
    return dataclasses.replace(res, token_ids=[], text="", completion_tokens=0, finish_reason="length")


def scored(result, lps: list) -> list:
    """The positions `best_of` ranks a candidate by: its output tokens less a stop token, whose logprobs
    come only where the request reported it (`report_stop_token`), so the ranking never depends on that."""
    return (
        lps[: result.completion_tokens - 1]
        if len(lps) == result.completion_tokens and ((result.stop_reason or "").startswith("token:"))
        else lps
    )


def best_of(results, token_logprobs, candidates: int, n: int):
    """Per prompt, the `n` of its `candidates` results with the highest summed log-probability (OpenAI's
    `best_of`), best first; their logprobs alongside."""
    out, lps = [], []
    for start in range(0, len(results), candidates):
        group = range(start, start + candidates)
        score = {i: sum(t.logprob for t in scored(results[i], token_logprobs[i])) for i in group}
        for i in sorted(group, key=lambda i: -score[i])[:n]:
            out.append(results[i])
            lps.append(token_logprobs[i])
    return out, lps


async def submitted(eng, generations, n: int = 1, submit=submit_all) -> list:
    """`submit(eng, generations, n)` (default `submit_all`) on a worker thread (validation walks every
    token id). If this coroutine is cancelled meanwhile, whatever the thread submits is cancelled when
    it is done: nobody will read it."""
    fut = asyncio.get_running_loop().run_in_executor(None, submit, eng, generations, n)
    try:
        handles = await asyncio.shield(fut)
    except asyncio.CancelledError:
        fut.add_done_callback(_cancel_submitted)
        raise
    hold(handles)  # their logprobs are kept until the response is sent (kvgate.server.held)
    return handles


def _cancel_submitted(fut) -> None:
    if not fut.cancelled() and fut.exception() is None:
        for h in fut.result():
            h.cancel()
            h.close()


async def admit_all(handles) -> list[Admitted]:
    """Every handle's admission; the first refusal cancels all the others at once and is raised."""
    tasks = [asyncio.ensure_future(h.await_admitted()) for h in handles]
    try:
        for next_done in asyncio.as_completed(tasks):
            await next_done  # raises the first refusal as soon as it comes
    except BaseException:
        for h in handles:
            h.cancel()
        for t in tasks:
            t.cancel()
        raise
    return [t.result() for t in tasks]


async def finish_all(handles, token_logprobs: list[list] | None = None, counters: list | None = None):
    """Each handle's result; `token_logprobs[i]` collects choice i's per-token logprobs, if any;
    `counters[i]`, a `ReasoningSplitter`, counts choice i's reasoning tokens."""

    async def one(i, h):
        async for ev in h.aevents():
            if isinstance(ev, Finished):
                return ev.result
            if counters is not None and isinstance(ev, Token):
                counters[i].push_token(ev.text)
            if token_logprobs is not None and isinstance(ev, Token) and ev.logprobs is not None:
                token_logprobs[i].append(ev.logprobs)

    return await asyncio.gather(*(one(i, h) for i, h in enumerate(handles)))


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
