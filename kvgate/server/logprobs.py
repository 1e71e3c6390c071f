"""Log-probabilities in OpenAI's two shapes, and the per-choice extras of a finished response.

Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}],
"refusal": null}`. Completions (legacy): `{"tokens", "token_logprobs", "top_logprobs": [{token:
logprob}], "text_offset"}`. `bytes` are a token's exact bytes (`TextTokenizer.token_bytes`), so a
character split across tokens is still reported exactly; its `token` string is the UTF-8 text, or
`bytes:\\xNN...` when the bytes are not whole characters (OpenAI's convention). A logprob of -inf (a
token the grammar forbids) is reported as -9999.0, as OpenAI does: JSON has no infinity.

Completions' `top_logprobs` hold the top k and the chosen token (up to k + 1 entries, as OpenAI
documents and vLLM gives; `logprobs: 0` gives the chosen token alone); an echoed prompt's first token
has none (null). Chat's `top_logprobs` are exactly the top k. `text_offset[i]` indexes the choice's
`text` (with echo: the prompt, then the output): the length of the text the tokens before token i
decode to, never the length of their `token` strings. A token that carries part of a character
gets the offset where that character starts (its text comes with the token that completes it), as
a stream's running count of the text sent so far gives it (vLLM's streamed offsets); bytes that
are not UTF-8 count as the U+FFFD the text shows, a special token the output leaves out as nothing.
The offsets never decrease and never pass the end of `text`. A stream gives a token that releases text
the offset the whole response does (`streamed_offset`; QA of session 45: a space with a partial
character, then the byte that completed it, streamed as 0, 0 where the whole response said 0, 1); a
token whose text is held back gets the length of the text sent so far, since what it holds may still
be cut as a stop string (the whole response can place it further in, before a U+FFFD or a space held
with a partial character that was not cut).

What the numbers are (kvgate.sampling): the log-softmax of the logits the sampler drew from, after
logit bias, penalties and the grammar mask, before temperature and top-k/top-p/min-p.
"""

from __future__ import annotations

import codecs
import itertools
import math

from kvgate.sampling import TokenLogprobs
from kvgate.tokenizer import IncrementalDetokenizer

FLOOR = -9999.0


def token_text(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def token_name(tok, token_id: int) -> str:
    """A token as a logprob entry names it: its text, or `token_id:<id>` where the request asked for
    ids (`vllm_extras.TokenIdNames`)."""
    if getattr(tok, "names_by_id", False):
        return f"token_id:{token_id}"
    return token_text(tok.token_bytes(token_id))


def json_logprob(v: float) -> float:
    return v if math.isfinite(v) else FLOOR


def chat_entry(tok, lp: TokenLogprobs) -> dict:
    raw = tok.token_bytes(lp.token_id)
    return {
        "token": token_name(tok, lp.token_id),
        "logprob": json_logprob(lp.logprob),
        "bytes": list(raw),
        "top_logprobs": [
            {"token": token_name(tok, i), "logprob": json_logprob(v), "bytes": list(tok.token_bytes(i))}
            for i, v in lp.top
        ],
    }


def chat_logprobs(tok, lps: list[TokenLogprobs]) -> dict:
    return {"content": [chat_entry(tok, lp) for lp in lps], "refusal": None}


def completion_top(tok, lp: TokenLogprobs) -> dict[str, float]:
    """The top k by logprob, then the chosen token when it is not among them."""
    top = {token_name(tok, i): json_logprob(v) for i, v in lp.top}
    if all(i != lp.token_id for i, _ in lp.top):
        top.setdefault(token_name(tok, lp.token_id), json_logprob(lp.logprob))
    return top


def completion_logprobs(
    tok, lps: list[TokenLogprobs], offset: int = 0, context: list[int] = (), limit: int | None = None
) -> dict:
    """`offset`: characters of text before the first of these tokens; the later ones' offsets follow
    the text the tokens decode to after `context`, the ids before them (`text_offsets`). A stream's
    chunk holds one token: its offset is the running length of the text sent before it."""
    ids = [lp.token_id for lp in lps]
    return {**_entries(tok, lps), "text_offset": text_offsets(tok, ids, offset, context, limit)}


def _entries(tok, lps: list[TokenLogprobs]) -> dict:
    return {
        "tokens": [token_name(tok, lp.token_id) for lp in lps],
        "token_logprobs": [json_logprob(lp.logprob) for lp in lps],
        "top_logprobs": [completion_top(tok, lp) for lp in lps],
    }


def text_offsets(tok, ids, start=0, context=(), limit=None, keep_special=False) -> list[int]:
    """Where each token's text starts: `start` plus the text released before it by the engine's own
    decoding of output (`IncrementalDetokenizer` after `context`), at most `limit`. A decoder holds
    back a partial character and releases it with the token that completes it; the tokens held
    back together are placed inside that released text by decoding their bytes as UTF-8 (a whole
    character once complete, a U+FFFD per invalid sequence), when those bytes give exactly that
    text, else all at its start. `keep_special`: special tokens decode to their text (an echoed
    prompt given as ids is decoded so)."""
    if len(ids) == 1:  # a streamed token: it starts where the text sent so far ends
        return [start if limit is None else min(start, limit)]
    detok = IncrementalDetokenizer(tok, list(context), skip_special=not keep_special)
    out: list[int] = []
    at, held = start, []
    for k, token in enumerate(ids):
        held.append(token)
        text = detok.push(token) + (detok.flush() if k + 1 == len(ids) else "")
        if text or k + 1 == len(ids):
            out += _place(tok, held, at, text)
            at, held = at + len(text), []
    return out if limit is None else [min(o, limit) for o in out]


def streamed_offset(tok, held: list[int], at: int, text: str) -> int:
    """A streamed token's offset: `held` are the ids since text was last released (this token last),
    which start at `at`; `text` is what this token released. A token that releases text is placed in
    it as `text_offsets` places it in the whole response; one whose text is held back gets `at`, the
    text sent so far (what it holds may yet be cut as a stop string: review of session 45)."""
    return _place(tok, held, at, text)[-1] if text else at


def _place(tok, held: list[int], at: int, text: str) -> list[int]:
    """Offsets of the tokens released together as `text`, which starts at `at` (the last ones' text
    may end in an incomplete character, which a flush drops or shows as U+FFFD)."""
    dec = codecs.getincrementaldecoder("utf-8")("replace")
    pieces = [dec.decode(tok.token_bytes(t)) for t in held]
    if text not in ("".join(pieces), "".join(pieces) + dec.decode(b"", final=True)):
        return [at] * len(held)
    return [at + n for n in itertools.accumulate((len(p) for p in pieces[:-1]), initial=0)]


def prompt_offsets(tok, prompt_ids: list[int], prompt_text: str) -> list[int]:
    """Each prompt token's offset in `prompt_text` (the echo: the prompt as sent, or its ids decoded
    with special tokens). Where the ids decode to more than that text before it (a BOS token the
    server added to a text prompt), that lead is taken off."""
    offsets = text_offsets(tok, prompt_ids, keep_special=True)
    whole = tok.decode(prompt_ids, skip_special_tokens=False)
    lead = len(whole) - len(prompt_text) if whole.endswith(prompt_text) else 0
    return [min(max(o - lead, 0), len(prompt_text)) for o in offsets]


def echoed_logprobs(
    tok,
    prompt_ids: list[int],
    scored: list[TokenLogprobs],
    prompt_text: str,
    output: list[TokenLogprobs] = (),
    limit: int | None = None,
) -> dict:
    """An echoed, scored prompt and its output in the completions shape: the prompt's first token has
    no log-probability (null, as OpenAI's echo gives it); `scored` holds the scores of the prompt's
    later tokens. Offsets index `prompt_text` followed by the output's text (at most `limit`)."""
    first = token_name(tok, prompt_ids[0])
    out = {"tokens": [first], "token_logprobs": [None], "top_logprobs": [None]}
    for lps in (scored, output):
        for key, values in _entries(tok, lps).items():
            out[key] += values
    after = text_offsets(tok, [lp.token_id for lp in output], len(prompt_text), prompt_ids, limit)
    out["text_offset"] = prompt_offsets(tok, prompt_ids, prompt_text) + after
    return out


def decorate_body(
    body: dict,
    prepared,
    tok,
    token_logprobs: list[list[TokenLogprobs]],
    scores: list | None = None,
    defer=None,
) -> None:
    """Add logprobs and echo to each choice of a finished (non-streaming) body (its tool calls were read
    before: `tools.read_calls`); `scores`: each prompt's scored tokens (echo with logprobs), whose
    entries come before the output's. `defer(i, choice, lps, echoed_prefix)`, when given, is called
    instead of building choice i's logprobs (`kvgate.server.logprob_body` writes them as they are sent)."""
    f = prepared.features
    for i, choice in enumerate(body["choices"]):
        prefix = echo_text(prepared, tok, i) if f.echo else ""
        if prefix:
            choice["text"] = prefix + choice["text"]
        if f.logprobs is not None:
            lps = token_logprobs[i]
            if defer is not None:
                defer(i, choice, lps, prefix)
            elif prepared.kind == "chat":
                choice["logprobs"] = chat_logprobs(tok, lps)
            elif scores is not None:
                k = i // prepared.n
                ids, end = prepared.generations[k].prompt_ids, len(choice["text"])
                choice["logprobs"] = echoed_logprobs(tok, ids, scores[k], prefix, lps, end)
            else:
                ids = prepared.generations[i // prepared.n].prompt_ids
                choice["logprobs"] = completion_logprobs(tok, lps, 0, ids, len(choice["text"]))


def echo_text(prepared, tok, choice: int) -> str:
    """The prompt of a choice as text (OpenAI's `echo`): as sent when it was text, else decoded."""
    k = choice // prepared.n
    prompt = prepared.request.prompt
    if k in getattr(prepared, "truncated", ()):  # truncate_prompt_tokens cut it: the part kept
        return tok.decode(prepared.generations[k].prompt_ids, skip_special_tokens=False)
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(x, str) for x in prompt):
        return prompt[k]
    return tok.decode(prepared.generations[k].prompt_ids, skip_special_tokens=False)
