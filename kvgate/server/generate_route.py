"""`POST /inference/v1/generate`: vLLM's token-in, token-out endpoint, over the completions path.

RL trainers (prime-rl through `renderers`, SkyRL) render their prompts themselves and send token ids:
`{"token_ids": [...], "sampling_params": {...}}`. The body becomes the text completion it stands for
(`to_completion`: the ids as the prompt, vLLM's sampling fields as the completion's, the answer's ids and
logprob names by id forced on) and is served by `serving.generate` exactly as one: the same admission,
refusals with their numbers, and memory. The answer is rewritten into vLLM's shape (`generate_body`):
`request_id`, `choices[].token_ids` (the stop token included), `finish_reason`, `stop_reason`, and
`logprobs.content` entries that name each token both ways vLLM has (`"token": "token_id:N"` before 0.32,
`"token_id": N` since), so clients of either read them; `prompt_token_ids` with `return_token_ids`.
Streamed, each chunk carries its new ids and their logprobs. An error's `param` is the body's own name
(`token_ids`, `sampling_params.temperature`). `prompt_logprobs: k` scores the prompt as the completion's
echo with logprobs k (so the answer's `logprobs`, if asked, take the same k), answered whole, as vLLM's
`prompt_logprobs`: None for the first token, then {id: {logprob, rank, decoded_token}} (rank and
decoded_token null here) for the prompt's token and the top k.

Not done, refused by name: `output_mode` other than "tokens" (no text here), multimodal `features` /
`content_parts`, `kv_transfer_params`, a full-vocabulary `logprobs: -1`, and
`priority` other than 0 (one FIFO queue). Unlike vLLM's, the route needs no `--enable-scale-out`.
"""

from __future__ import annotations

import json
import re
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvgate.server import protocol as P
from kvgate.server.bodies import parse_json, read_body
from kvgate.server.errors import APIError, invalid, unsupported
from kvgate.server.serving import generate
from kvgate.server.sse import DONE, HandledStream, chat_chunks, event

# vLLM's SamplingParams fields the completions path takes under the same names
SAMPLING = (
    "n",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "max_tokens",
    "min_tokens",
    "logprobs",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
    "allowed_token_ids",
    "bad_words",
    "logit_bias",
    "structured_outputs",
    "truncate_prompt_tokens",
)
IGNORED = ("detokenize", "output_kind")  # no text is returned; the server sets how outputs come
TOP = ("model", "token_ids", "sampling_params", "stream", "stream_options", "request_id", "cache_salt")
CHECKED = ("priority", "output_mode", "return_token_ids")  # taken with the values `to_completion` allows
NULL_ONLY = {
    "kv_transfer_params": "disaggregated prefill is not implemented",
    "ec_transfer_params": "disaggregated encoding is not implemented",
    "features": "multimodal input is not implemented; this model reads text",
    "content_parts": "multimodal input is not implemented; this model reads text",
}
_KEPT_HEADERS = ("retry-after", "retry-after-ms", "x-kvgate-budget-cap", "x-request-id")
MAX_REQUEST_ID = 128
# what a non-streamed answer holds a position of logprobs while it is rewritten (the completion's JSON,
# its parse, this route's entries): tracemalloc, 2,000 positions, measured 2,120 B at logprobs 0,
# 2,993 at 1 and 4,561 at 5 (the review of session 46); reserved as 2,400 + 800 a top entry
HOLD_BYTES, HOLD_TOP_BYTES = 2400, 800


def hold_bytes(k: int | None) -> int:
    return 0 if k is None else HOLD_BYTES + HOLD_TOP_BYTES * k


def to_completion(body) -> tuple[dict, str, bool | None]:
    """The text completion body a generate body asks for, the answer's request id, and whether the
    prompt is scored (None: no; else whether the answer's own logprobs were asked too: `_scored_prompt`);
    a 400 naming the generate body's field where it asks for something kvgate does not do."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object", code="invalid_json")
    for name in body:
        if name in NULL_ONLY and body[name] is not None:
            raise unsupported(name, NULL_ONLY[name] + " (null, or leaving it out, is accepted)")
        if name in TOP or name in CHECKED or name in NULL_ONLY:
            continue
        raise unsupported(name, "unknown field; remove it (kvgate refuses fields it would otherwise ignore)")
    if body.get("priority") not in (None, 0):
        raise unsupported("priority", "one FIFO queue serves every request here: send 0 or leave it out")
    if body.get("output_mode") not in (None, "tokens"):
        raise unsupported("output_mode", 'only "tokens" is served: the answer is ids (send "tokens")')
    ids = body.get("token_ids")
    if not isinstance(ids, list) or not ids or not all(type(t) is int for t in ids):
        raise invalid("token_ids must be a non-empty list of token ids (the rendered prompt)", "token_ids")
    rid = body.get("request_id")
    if rid is not None and not (isinstance(rid, str) and 0 < len(rid) <= MAX_REQUEST_ID):
        raise invalid(f"request_id must be a string of 1 to {MAX_REQUEST_ID} characters", "request_id")
    if body.get("return_token_ids") not in (None, True, False):
        raise invalid("return_token_ids must be true or false", "return_token_ids")
    opts = body.get("stream_options")
    if isinstance(opts, dict) and opts.get("include_obfuscation"):
        raise unsupported(
            "stream_options.include_obfuscation",
            "this route's chunks are not padded: send false or leave it out",
        )
    params = body.get("sampling_params")
    if not isinstance(params, dict):
        raise invalid(
            "sampling_params must be an object (vLLM's SamplingParams: {} for its defaults)",
            "sampling_params",
        )
    out = {k: body[k] for k in ("model", "stream", "stream_options", "cache_salt") if body.get(k) is not None}
    out.update(prompt=ids, return_token_ids=True, return_tokens_as_token_ids=True)
    for name, value in params.items():
        if name in IGNORED or value is None or name == "prompt_logprobs":
            continue
        if name not in SAMPLING:
            raise unsupported(f"sampling_params.{name}", "not implemented here; remove it")
        out[name] = value
    scored = _scored_prompt(params.get("prompt_logprobs"), out)
    if out.get("logprobs") == -1:
        raise unsupported("sampling_params.logprobs", "-1 (the whole vocabulary) is not served: send 0 to 5")
    if isinstance(out.get("logit_bias"), dict):  # vLLM's keys are ints; JSON's are strings either way
        out["logit_bias"] = {str(k): v for k, v in out["logit_bias"].items()}
    return out, f"generate-tokens-{rid or uuid.uuid4().hex}", scored


def _scored_prompt(k, out: dict) -> bool | None:
    """vLLM's `prompt_logprobs: k`: the prompt scored as a text completion's echo with logprobs k, which
    are then the answer's logprobs too (one count serves both there); answered whole. Whether the answer's
    own logprobs were asked, or None without `prompt_logprobs`."""
    if k is None:
        return None
    if type(k) is not int or not 0 <= k <= 5:
        raise invalid(
            f"prompt_logprobs={k!r} must be an integer from 0 to 5 here", "sampling_params.prompt_logprobs"
        )
    if out.get("logprobs") not in (None, k):
        raise unsupported(
            "sampling_params.prompt_logprobs",
            f"the prompt is scored with the answer's logprobs count: send logprobs={k} too, or leave it out",
        )
    if out.get("stream") is True:
        raise unsupported(
            "sampling_params.prompt_logprobs", "a scored prompt is answered whole: send stream false"
        )
    asked = out.get("logprobs") is not None
    out.update(echo=True, logprobs=k)
    return asked


def prompt_scores(lp: dict, P: int) -> list:
    """The first `P` (prompt) positions of an echoed answer's logprobs as vLLM's `prompt_logprobs`: None
    for the first token, then {token id: {"logprob", "rank", "decoded_token"}} for the token and the top k."""
    out: list = [None]
    for i in range(1, P):
        # a completion's top entries hold the position's own token too (logprobs.completion_top)
        out.append(
            {
                str(_ids(t)): {"logprob": v, "rank": None, "decoded_token": None}
                for t, v in lp["top_logprobs"][i].items()
            }
        )
    return out


def output_part(lp: dict, P: int) -> dict:
    """An echoed answer's logprobs past its `P` prompt positions."""
    return {k: v[P:] for k, v in lp.items() if k != "text_offset"}


def generate_message(message: str) -> str:
    """A completions error's text in the generate body's names: `'prompt'`, and `name=` / `'name'` of
    the sampling fields (prose that says "prompt" is left as it is)."""
    message = message.replace("'prompt'", "'token_ids'").replace("top_logprobs=", "logprobs=")
    return _NAMED.sub(lambda m: m.group(1) + "sampling_params." + m.group(2) + m.group(3), message)


_NAMED = re.compile(r"(^|[\s'(])(" + "|".join(sorted(SAMPLING, key=len, reverse=True)) + r")(=|')")


def generate_param(param: str | None) -> str | None:
    """A completions field's name as the generate body names it."""
    if param is None:
        return None
    head = param.split(".", 1)[0]
    if head == "prompt":
        return "token_ids" + param[len("prompt") :]
    if head in SAMPLING:
        return "sampling_params." + param
    return param


def _ids(name: str) -> int:
    return int(name.split(":", 1)[1])  # "token_id:N", as return_tokens_as_token_ids names them


def content(lp: dict | None) -> dict | None:
    """A completions choice's logprobs (tokens named by id) as vLLM's generate `logprobs.content`."""
    if lp is None:
        return None
    entries = []
    for name, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True):
        alts = [{"token": t, "token_id": _ids(t), "logprob": v} for t, v in (top or {}).items()]
        entries.append({"token": name, "token_id": _ids(name), "logprob": value, "top_logprobs": alts})
    return {"content": entries}


def choice(c: dict) -> dict:
    return {
        "index": c["index"],
        "finish_reason": c.get("finish_reason"),
        "stop_reason": c.get("stop_reason"),
        "token_ids": c.get("token_ids") or [],
        "logprobs": content(c.get("logprobs")),
    }


def generate_body(answer: dict, rid: str, prompt_ids: bool, scored: bool | None = None) -> dict:
    """`scored`: the prompt was scored (echo), and whether the answer's own logprobs were asked too."""
    if scored is not None:
        P = answer["usage"]["prompt_tokens"]
        scores = prompt_scores(answer["choices"][0]["logprobs"], P)
        for c in answer["choices"]:
            c["logprobs"] = output_part(c["logprobs"], P) if scored else None
    out = {
        "request_id": rid,
        "model": answer["model"],
        "created": answer["created"],
        "usage": answer["usage"],
        "prompt_logprobs": scores if scored is not None else None,
        "kv_transfer_params": None,
        "output_mode": "tokens",
        "choices": [choice(c) for c in answer["choices"]],
    }
    if prompt_ids:
        out["prompt_token_ids"] = answer["choices"][0].get("prompt_token_ids")
    return out


async def inference_generate(request: Request) -> Response:
    settings = request.app.state.settings
    raw = await read_body(request, settings.max_body_bytes)
    body = parse_json(raw)
    completion, rid, scored = to_completion(body)
    with_prompt = body.get("return_token_ids") is True
    streamed = completion.get("stream") is True
    try:
        answer = await generate(
            request,
            P.CompletionRequest,
            raw=json.dumps(completion).encode(),
            whole=not streamed,  # a stream's chunks are rewritten one at a time: nothing is held
            hold=hold_bytes,
            prompt_ids="first" if with_prompt else "none",
        )
    except APIError as e:
        e.param, e.message = generate_param(e.param), generate_message(e.message)
        raise
    headers = {k: v for k, v in answer.headers.items() if k.lower() in _KEPT_HEADERS}
    if answer.status_code != 200:  # a refusal's body (or 499, none): its param in the generate body's names
        if not answer.body:
            return answer
        err = json.loads(answer.body)
        err["error"]["param"] = generate_param(err["error"].get("param"))
        err["error"]["message"] = generate_message(err["error"]["message"])
        return JSONResponse(err, status_code=answer.status_code, headers=headers)
    if isinstance(answer, StreamingResponse):
        headers.update({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        chunks = _chunks(answer.body_iterator, rid, with_prompt)
        return HandledStream(
            chunks, answer.handles, answer.on_result, began=lambda: answer.began, headers=headers
        )
    return JSONResponse(generate_body(json.loads(answer.body), rid, with_prompt, scored), headers=headers)


async def _chunks(stream, rid: str, with_prompt: bool):
    """The completions stream's chunks in, vLLM's generate chunks out: a chunk per new ids (or a
    finish), the prompt's ids on each choice's first with `return_token_ids`, usage as sent, errors as
    they come."""
    try:
        async for chunk in chat_chunks(stream):
            if "error" in chunk:
                err = chunk["error"]
                err["param"], err["message"] = (
                    generate_param(err.get("param")),
                    generate_message(err["message"]),
                )
                yield event(chunk)
                continue
            out = {
                "request_id": rid,
                "created": chunk.get("created", int(time.time())),
                "output_mode": "tokens",
            }
            out["usage"] = chunk.get("usage")
            if not chunk["choices"]:  # the usage chunk
                yield event({**out, "choices": []})
                continue
            c = chunk["choices"][0]
            if not c.get("token_ids") and c.get("finish_reason") is None and "prompt_token_ids" not in c:
                continue  # text released with no new ids (a held-back tail): nothing in tokens mode
            if with_prompt and "prompt_token_ids" in c:
                out["prompt_token_ids"] = c["prompt_token_ids"]
            yield event({**out, "choices": [choice(c)]})
        yield DONE
    finally:
        await stream.aclose()
