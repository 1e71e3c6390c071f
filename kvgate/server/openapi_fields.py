"""The OpenAPI document's rules for issue 13's fields (logprobs, logit_bias, tools, response_format),
for OpenAI's fields accepted only as null (`functions`, `audio`, a replayed message's `function_call`,
...; `modalities` also as ["text"]), and for `stream_options`, which needs `stream: true`.

Split from `openapi.py` (which calls `tighten_features` for each completion body and
`tighten_message` for the message schema): the ranges prepare enforces, and what one field requires of
another, written as JSON Schema `if`/`then` so that a body the document allows is one the server
accepts, as tests/test_fuzz.py checks.
"""

from __future__ import annotations

from kvgate.sampling import LOGIT_BIAS_LIMIT, MAX_TOP_LOGPROBS
from kvgate.server.features import MAX_COMPLETION_LOGPROBS
from kvgate.server.protocol import NULL_ONLY
from kvgate.server.vllm_extras import MAX_BAD_WORD_CHARS, MAX_BAD_WORDS, MAX_SALT_CHARS

_NULL = {"type": "null"}
_IDS = {"type": "array", "items": {"type": "integer"}}
# a choice's vLLM fields: `stop_reason` (the stop string, or the request's stop_token_ids token, that
# ended it) and `return_token_ids`' ids (chat's prompt ids are at the top of the body; a choice of a
# text completion carries its own prompt's)
VLLM_CHOICE = {"stop_reason": {"anyOf": [_NULL, {"type": "string"}, {"type": "integer"}]}}
VLLM_CHOICE.update(token_ids=_IDS, prompt_token_ids=_IDS)


def tighten_features(js: dict, vocab: int | None, chat: bool) -> None:
    props = js["properties"]
    for name in NULL_ONLY:  # kvgate.server.protocol refuses anything but null, by name
        if name in props:
            props[name] = _NULL
    if "modalities" in props:
        text = {"type": "array", "minItems": 1, "items": {"const": "text"}}
        props["modalities"] = {"anyOf": [text, _NULL]}
    if chat:
        props["logprobs"] = {"type": ["boolean", "null"]}
        props["top_logprobs"] = {
            "anyOf": [{"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS}, _NULL]
        }
    else:
        lp = {"type": "integer", "minimum": 0, "maximum": MAX_COMPLETION_LOGPROBS}
        props["logprobs"] = {"anyOf": [lp, {"const": False}, _NULL]}
        props["top_logprobs"] = _NULL
    bias = {"type": "number", "minimum": -LOGIT_BIAS_LIMIT, "maximum": LOGIT_BIAS_LIMIT}
    ids = {"pattern": _below(vocab) if vocab else "^[0-9]+$"}
    props["logit_bias"] = {
        "anyOf": [{"type": "object", "propertyNames": ids, "additionalProperties": bias}, _NULL]
    }
    _vllm_extras(props, vocab)
    # what one field requires of another (prepare's checks, kvgate.server.features)
    rules = []
    if chat:
        rules.append(
            _needs({"top_logprobs": {"type": "integer", "minimum": 1}}, {"logprobs": {"const": True}})
        )
        picks = {"tool_choice": {"not": {"anyOf": [{"const": "none"}, _NULL]}}}
        rules.append(_needs(picks, {"tools": {"type": "array", "minItems": 1}}))
    else:
        # echo with logprobs scores the prompt, answered whole (kvgate.server.features)
        scored = {"echo": {"const": True}, "logprobs": {"type": "integer"}}
        rules.append(_needs(scored, {"stream": {"anyOf": [_NULL, {"const": False}]}}, False))
        # max_tokens 0 echoes (and with logprobs scores) the prompt alone; without echo it is a 400
        for b in (
            b for b in props["max_tokens"].get("anyOf", [props["max_tokens"]]) if b.get("type") == "integer"
        ):
            b["minimum"] = 0
        rules.append(_needs({"max_tokens": {"const": 0}}, {"echo": {"const": True}}))
        rules.append(
            _needs({"max_tokens": {"const": 0}}, {"stream": {"anyOf": [_NULL, {"const": False}]}}, False)
        )
    fmt = {"response_format": {"type": "object", "properties": {"type": {"const": "json_schema"}}}}
    with_schema = {
        "required": ["json_schema"],
        "properties": {"json_schema": {"type": "object", "required": ["schema"]}},
    }
    rules.append(_needs(fmt, {"response_format": with_schema}))
    # stream_options (not null) needs stream true (protocol.check_common)
    rules.append(_needs({"stream_options": {"type": "object"}}, {"stream": {"const": True}}))
    js["allOf"] = rules


def _vllm_extras(props: dict, vocab: int | None) -> None:
    """vLLM's extras (kvgate.server.vllm_extras): the sizes and characters `check_extras` enforces."""
    token = {"type": "integer", "minimum": 0, **({"maximum": vocab - 1} if vocab else {})}
    props["allowed_token_ids"] = {"anyOf": [{"type": "array", "minItems": 1, "items": token}, _NULL]}
    word = {"type": "string", "minLength": 1, "maxLength": MAX_BAD_WORD_CHARS}
    props["bad_words"] = {"anyOf": [{"type": "array", "maxItems": MAX_BAD_WORDS, "items": word}, _NULL]}
    salt = {"type": "string", "minLength": 1, "maxLength": MAX_SALT_CHARS}
    props["cache_salt"] = {"anyOf": [salt, _NULL]}
    props["truncate_prompt_tokens"] = {"anyOf": [{"type": "integer", "minimum": -1}, _NULL]}


def tighten_message(msg: dict) -> None:
    """A replayed response's own fields: null, and `annotations` also empty (protocol.chat_messages)."""
    props = msg["properties"]
    props["audio"] = props["function_call"] = _NULL
    props["annotations"] = {"anyOf": [{"type": "array", "maxItems": 0}, _NULL]}


def _needs(when: dict, then: dict, required: bool = True) -> dict:
    """JSON Schema for "if these properties look like `when`, they must also look like `then`"."""
    then_schema: dict = {"properties": then}
    if required:
        then_schema["required"] = sorted(then)
    return {"if": {"properties": when, "required": sorted(when)}, "then": then_schema}


def _below(n: int) -> str:
    """A regex for the decimal integers 0 <= i < n, written without leading zeros."""
    m = str(n - 1)
    if len(m) == 1:
        return f"^[0-{m}]$"
    alts = ["0", f"[1-9][0-9]{{0,{len(m) - 2}}}"]
    for i, ch in enumerate(m):
        lo = 1 if i == 0 else 0
        if int(ch) > lo:
            alts.append(m[:i] + f"[{lo}-{int(ch) - 1}]" + "[0-9]" * (len(m) - i - 1))
    alts.append(m)
    return "^(" + "|".join(alts) + ")$"
