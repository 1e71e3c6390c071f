"""Log-probabilities in OpenAI's two shapes, and the per-choice extras of a finished response.

Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}],
"refusal": null}`. Completions (legacy): `{"tokens", "token_logprobs", "top_logprobs": [{token:
logprob}], "text_offset"}`. `bytes` are a token's exact bytes (`TextTokenizer.token_bytes`), so a
character split across tokens is still reported exactly; its `token` string is the UTF-8 text, or
`bytes:\\xNN...` when the bytes are not whole characters (OpenAI's convention). A logprob of -inf (a
token the grammar forbids) is reported as -9999.0, as OpenAI does: JSON has no infinity.

What the numbers are (kvgate.sampling): the log-softmax of the logits the sampler drew from, after
logit bias, penalties and the grammar mask, before temperature and top-k/top-p/min-p.
"""

from __future__ import annotations

import math

from kvgate.sampling import TokenLogprobs
from kvgate.server import tools as T

FLOOR = -9999.0


def token_text(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def _lp(v: float) -> float:
    return v if math.isfinite(v) else FLOOR


def chat_entry(tok, lp: TokenLogprobs) -> dict:
    raw = tok.token_bytes(lp.token_id)
    return {
        "token": token_text(raw),
        "logprob": _lp(lp.logprob),
        "bytes": list(raw),
        "top_logprobs": [
            {"token": token_text(b := tok.token_bytes(i)), "logprob": _lp(v), "bytes": list(b)}
            for i, v in lp.top
        ],
    }


def chat_logprobs(tok, lps: list[TokenLogprobs]) -> dict:
    return {"content": [chat_entry(tok, lp) for lp in lps], "refusal": None}


def completion_logprobs(tok, lps: list[TokenLogprobs], offset: int = 0) -> dict:
    """`offset`: characters of text before the first of these tokens (for `text_offset`)."""
    out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for lp in lps:
        text = token_text(tok.token_bytes(lp.token_id))
        out["tokens"].append(text)
        out["token_logprobs"].append(_lp(lp.logprob))
        out["top_logprobs"].append({token_text(tok.token_bytes(i)): _lp(v) for i, v in lp.top})
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def echoed_logprobs(tok, prompt_ids: list[int], scored: list[TokenLogprobs]) -> dict:
    """An echoed, scored prompt and its output in the completions shape: the prompt's first token has
    no log-probability (null, as OpenAI's echo gives it); `scored` holds the scores of the prompt's
    later tokens, then the output's. `text_offset` runs over the tokens' text from 0, so it never
    steps back where that text is not the prompt as sent (a BOS token, byte pieces)."""
    first = token_text(tok.token_bytes(prompt_ids[0]))
    out = {"tokens": [first], "token_logprobs": [None], "top_logprobs": [None], "text_offset": [0]}
    for key, values in completion_logprobs(tok, scored, len(first)).items():
        out[key] += values
    return out


def decorate_body(
    body: dict, prepared, tok, token_logprobs: list[list[TokenLogprobs]], scores: list | None = None
) -> None:
    """Add tool calls, logprobs and echo to each choice of a finished (non-streaming) body; `scores`:
    each prompt's scored tokens (echo with logprobs), whose entries come before the output's."""
    f = prepared.features
    for i, choice in enumerate(body["choices"]):
        if f.tools is not None:
            content, calls = T.parse_output(choice["message"]["content"])
            if calls and all(c.done for c in calls):
                choice["message"] = {
                    "role": "assistant",
                    "content": content,
                    "tool_calls": T.call_dicts(calls),
                }
                if choice["finish_reason"] == "stop":
                    choice["finish_reason"] = "tool_calls"
        prefix = echo_text(prepared, tok, i) if f.echo else ""
        if prefix:
            choice["text"] = prefix + choice["text"]
        if f.logprobs is not None:
            lps = token_logprobs[i]
            if prepared.kind == "chat":
                choice["logprobs"] = chat_logprobs(tok, lps)
            elif scores is not None:
                k = i // prepared.n
                choice["logprobs"] = echoed_logprobs(tok, prepared.generations[k].prompt_ids, scores[k] + lps)
            else:
                choice["logprobs"] = completion_logprobs(tok, lps, len(prefix))


def echo_text(prepared, tok, choice: int) -> str:
    """The prompt of a choice as text (OpenAI's `echo`): as sent when it was text, else decoded."""
    k = choice // prepared.n
    prompt = prepared.request.prompt
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(x, str) for x in prompt):
        return prompt[k]
    return tok.decode(prepared.generations[k].prompt_ids, skip_special_tokens=False)
