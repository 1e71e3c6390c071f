"""The HTTP routes. Each is short: readiness, then a plain function from another module.

Generation lives in `serving.py`, request building in `prepare.py`, bodies in `bodies.py`; anything
heavier than a dictionary lookup (JSON parsing, templating, tokenizing) runs off the event loop.
"""

from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvgate.memory.overhead import process_peak_rss_bytes, process_rss_bytes
from kvgate.server import protocol as P
from kvgate.server.bodies import read_body
from kvgate.server.context import check_model, ready_engine
from kvgate.server.generate_route import inference_generate
from kvgate.server.messages_route import count_tokens, messages
from kvgate.server.prepare import prepare_detokenize, prepare_tokenize
from kvgate.server.responses_route import cancel_response, input_items, responses, stored_response
from kvgate.server.serving import generate
from kvgate.tokenizer import FALLBACK_TEMPLATE


async def health(request: Request):
    state = request.app.state
    eng = state.engine
    if state.status == "shutting_down":
        return JSONResponse({"status": "shutting_down"}, status_code=503, headers={"Retry-After": "5"})
    if eng is None:
        body = {"status": "loading" if state.load_error is None else "failed", "reason": state.load_error}
        return JSONResponse(body, status_code=503, headers={"Retry-After": "5"})
    if not eng.alive:  # no Retry-After: this process will not serve again; restart it
        return JSONResponse({"status": "dead", "reason": "the engine worker stopped"}, status_code=503)
    stall = eng.stalled()
    if stall is not None:  # a step past its timeout may still end (QA pass 9: no Retry-After was sent)
        return JSONResponse(
            {"status": "stalled", "reason": stall}, status_code=503, headers={"Retry-After": "5"}
        )
    return {"status": "ok"}


async def prometheus_metrics(request: Request):
    return Response(generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def _model_card(state) -> dict:
    card = {
        "id": state.settings.model_name,
        "object": "model",
        "created": state.started_at,
        "owned_by": "kvgate",
    }
    if state.engine is None:  # loading (or failed): the 503 with Retry-After, as llama.cpp's server; a
        ready_engine(state)  # card without its context was cached by LiteLLM's proxy for 300 s (QA 16)
    card["max_model_len"] = state.engine.max_model_len
    return card


async def models(request: Request):
    return {"object": "list", "data": [_model_card(request.app.state)]}


async def model(request: Request, model_id: str):
    """OpenAI's retrieve-model: the served model's card, or 404 for any other id."""
    state = request.app.state
    check_model(state.settings, model_id or None)
    return _model_card(state)


async def resources(request: Request):
    state = request.app.state
    eng = ready_engine(state)
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
            "blocks_cached": snap.kv_blocks_cached,
            "blocks_peak": snap.counters.kv_blocks_peak,
            "block_size": plan.block_size,
            "bytes_per_token": plan.kv_bytes_per_token,
            "dtype": str(eng.kv_dtype).removeprefix("torch."),  # --kv-dtype as resolved (int8: with scales)
            "prefix_cache": eng.sched_cfg.prefix_cache,
            "prefix_cache_queries_tokens": snap.counters.prefix_cache_queries_tokens,
            "prefix_cache_hits_tokens": snap.counters.prefix_cache_hits_tokens,
        },
        "scheduler": {
            "running": snap.running,
            "waiting": snap.waiting,
            "max_seqs": plan.limits.max_seqs,
            "prefill_chunk": plan.limits.prefill_chunk,
            "max_model_len": eng.max_model_len,
            # what --cuda-graphs did at startup: shapes captured, their measured pool and its charge
            "cuda_graphs": getattr(eng, "graphs_note", None),  # None: a cluster front end (its replicas say)
        },
        # measured, outside the ledger: the process's resident memory now, its peak, and the peak it
        # reached while loading, before the ledger existed (see the README)
        "process": {
            "rss_bytes": _or_none(process_rss_bytes),
            "peak_rss_bytes": process_peak_rss_bytes(),
            "load_peak_rss_bytes": getattr(state, "load_peak_bytes", None),
        },
        "live": state.live.summary(),
        "responses_store": state.responses.summary(),  # its limit: the plan's term (a CPU's ledger holds it)
    }


def _or_none(measure):
    try:
        return measure()
    except OSError:  # no /proc here: absent, not zero
        return None


async def tokenize(request: Request):
    state = request.app.state
    eng = ready_engine(state)
    raw = await read_body(request, state.settings.max_body_bytes)
    return await asyncio.to_thread(prepare_tokenize, raw, eng, state.settings)


async def detokenize(request: Request):
    state = request.app.state
    eng = ready_engine(state)
    raw = await read_body(request, state.settings.max_body_bytes)
    return await asyncio.to_thread(prepare_detokenize, raw, eng, state.settings)


async def tokenizer_info(request: Request):
    """vLLM's `GET /tokenizer_info`: the special tokens and chat template a client needs to tokenize as
    the server does. lm-evaluation-harness's `tokenizer_backend=auto` probes it and `/tokenize` at the
    root; without them it looked for the model on the Hugging Face hub (QA pass 8)."""
    eng = ready_engine(request.app.state)
    tok, info = eng.tokenizer, eng.tokenizer.info

    def text(i):
        return None if i is None else tok.token_text(i)

    return {
        "eos_token": text(info.eos_token_id),
        "bos_token": text(info.bos_token_id),
        "pad_token": None,
        "chat_template": info.chat_template or FALLBACK_TEMPLATE,  # the one chat requests render with
        "model_max_length": eng.max_model_len,
        "add_bos_token": info.add_bos_token,
    }


async def chat_completions(request: Request):
    return await generate(request, P.ChatCompletionRequest)


async def completions(request: Request):
    return await generate(request, P.CompletionRequest)


ROUTES = [
    ("GET", "/health", health),
    ("GET", "/metrics", prometheus_metrics),
    ("GET", "/v1/models", models),
    ("GET", "/v1/models/{model_id:path}", model),
    ("GET", "/v1/resources", resources),
    ("POST", "/v1/tokenize", tokenize),
    ("POST", "/v1/detokenize", detokenize),
    ("POST", "/v1/chat/completions", chat_completions),
    ("POST", "/v1/completions", completions),
    ("POST", "/v1/responses", responses),
    ("GET|DELETE", "/v1/responses/{response_id}", stored_response),
    ("GET", "/v1/responses/{response_id}/input_items", input_items),
    ("POST", "/v1/responses/{response_id}/cancel", cancel_response),
]
# Anthropic's Messages API (kvgate.server.messages_route) and vLLM's generate route
# (kvgate.server.generate_route): outside the OpenAPI document, which describes the OpenAI API
MESSAGES_ROUTES = [
    ("POST", "/v1/messages", messages),
    ("POST", "/v1/messages/count_tokens", count_tokens),
    ("POST", "/inference/v1/generate", inference_generate),  # vLLM's token-in, token-out (also not OpenAI's)
]


# vLLM serves these at the root too, and clients look for them there (lm-eval's remote tokenizer); the
# same handlers as /v1/'s, behind the same API key (auth.ROOT_API), left out of the OpenAPI document
ROOT_ALIASES = [
    ("GET", "/tokenizer_info", tokenizer_info),
    ("POST", "/tokenize", tokenize),
    ("POST", "/detokenize", detokenize),
]


def install_routes(app: FastAPI) -> None:
    # Registered on the app itself (not an APIRouter): FastAPI 0.165 keeps an included router as one
    # opaque route, which would hide the paths from anything that lists `app.routes`.
    for method, path, endpoint in ROUTES:
        app.add_api_route(path, endpoint, methods=method.split("|"))
    for method, path, endpoint in ROOT_ALIASES + MESSAGES_ROUTES:
        app.add_api_route(path, endpoint, methods=[method], include_in_schema=False)
