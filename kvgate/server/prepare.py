"""From request bytes to engine requests, off the event loop.

`prepare_generation(raw, cls, engine, settings)` parses and validates a chat or text completion body,
renders the chat template, tokenizes, and builds one `GenerationRequest` per prompt; `submit_all`
hands them to the engine, whose `submit` validates each one (`GenerationRequest.validate`, the rules'
one owner) before its admission gate. Both are plain synchronous code run through `asyncio.to_thread`:
templating, tokenizing and checking a 1 MiB prompt take about a second on these CPUs, and the
tokenizer call releases the GIL (`TextTokenizer.encode`), so the event loop keeps serving every open
stream meanwhile. Every problem is an `APIError` (400 naming the field, 404 for a wrong model) or the
engine's `Refusal`.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvgate.request import GenerationRequest, RequestError, check_max_tokens, check_token_ids
from kvgate.sampling import SamplingError, SamplingParams
from kvgate.server import protocol as P
from kvgate.server.bodies import parse_json
from kvgate.server.context import ServerSettings, check_model
from kvgate.server.errors import invalid
from kvgate.tokenizer import ChatTemplateError


@dataclass
class Prepared:
    kind: str  # "chat" | "completion"
    request: P.ChatCompletionRequest | P.CompletionRequest
    generations: list[GenerationRequest]

    @property
    def stream(self) -> bool:
        return self.request.stream

    @property
    def include_usage(self) -> bool:
        opts = self.request.stream_options
        return bool(opts and opts.include_usage)


def prepare_generation(raw: bytes, cls, engine, settings: ServerSettings) -> Prepared:
    req = P.parse(cls, parse_json(raw))
    P.check_common(req)
    if isinstance(req, P.CompletionRequest):
        P.check_completion(req)
    check_model(settings, req.model)
    prompts = prompt_ids(engine, req)
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
    max_tokens, param = P.max_tokens_of(req)
    gens = [
        GenerationRequest(
            ids, sampling, max_tokens, P.stop_list(req), list(req.stop_token_ids or []), req.ignore_eos
        )
        for ids in prompts
    ]
    try:
        check_max_tokens(max_tokens, param)
    except RequestError as exc:
        raise invalid(str(exc), param=exc.param) from None
    return Prepared(P.request_kind(req), req, gens)


def submit_all(engine, generations: list[GenerationRequest]) -> list:
    """Submit every prompt or none (`Engine.submit_many`); an invalid field is a 400 naming it."""
    try:
        return engine.submit_many(generations)
    except (RequestError, SamplingError) as exc:
        raise invalid(str(exc), param=exc.param) from None


def prompt_ids(engine, req) -> list[list[int]]:
    tok = engine.tokenizer
    if isinstance(req, P.ChatCompletionRequest):
        return [chat_ids(engine, P.chat_messages(req))]
    p = req.prompt
    if isinstance(p, str):
        out = [tok.encode(p)]
    elif not p:
        raise invalid("prompt must not be empty", param="prompt")
    elif all(isinstance(x, str) for x in p):
        out = [tok.encode(x) for x in p]
    elif all(isinstance(x, int) for x in p):
        out = [list(p)]
    else:
        out = [list(x) for x in p]
    if any(not ids for ids in out):  # refused here, not by the engine: an empty prompt is bad input
        raise invalid("prompt must not be empty: send at least one token of prompt", param="prompt")
    return out


def chat_ids(engine, messages: list[dict]) -> list[int]:
    try:
        return engine.tokenizer.chat_ids(messages)
    except ChatTemplateError as exc:
        raise invalid(str(exc), param="messages") from None


def check_ids(engine, ids, param: str) -> None:
    try:
        check_token_ids(ids, engine.tokenizer.vocab_size, param)
    except RequestError as exc:
        raise invalid(str(exc), param=param) from None


def prepare_tokenize(raw: bytes, engine, settings: ServerSettings) -> dict:
    req = P.parse(P.TokenizeRequest, parse_json(raw))
    check_model(settings, req.model)
    if (req.prompt is None) == (req.messages is None):
        raise invalid("send exactly one of 'prompt' or 'messages'", param="prompt")
    if req.messages is not None:
        ids = chat_ids(engine, P.chat_messages(P.ChatCompletionRequest(messages=req.messages)))
    else:
        ids = engine.tokenizer.encode(req.prompt, add_bos=None if req.add_special_tokens else False)
    return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}


def prepare_detokenize(raw: bytes, engine, settings: ServerSettings) -> dict:
    req = P.parse(P.DetokenizeRequest, parse_json(raw))
    check_model(settings, req.model)
    check_ids(engine, req.tokens, "tokens")
    return {"prompt": engine.tokenizer.decode(req.tokens, skip_special_tokens=False)}
