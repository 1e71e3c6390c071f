"""OpenAI response bodies: whole completions, stream chunks, usage, and the finish reasons clients see.

kvgate's engine ends a request with `stop`, `length`, `cancelled` or `error`. Clients only know
OpenAI's reasons, so `cancelled` (output cut short by a shutdown's grace running out) is reported as
`length`, OpenAI's "the output was truncated"; `error` never appears in a body: a failed request is a
500 with the stable error body, or an SSE error event, instead.
"""

from __future__ import annotations

from kvgate.request import Result

_FINISH = {"stop": "stop", "length": "length", "cancelled": "length", "tool_calls": "tool_calls"}


def finish_reason(reason: str) -> str:
    return _FINISH[reason]


def named_stop_ids(req, tok) -> frozenset[int]:
    """The ids a `stop_reason` names: the request's `stop_token_ids`, less the model's own end tokens
    where those end it anyway (vLLM checks the end first and names none)."""
    ids = frozenset(getattr(req, "stop_token_ids", None) or ())
    return ids if getattr(req, "ignore_eos", False) or tok is None else ids - tok.eog_ids


def stop_reason(result: Result, stop_token_ids=()) -> str | int | None:
    """vLLM's `stop_reason` of a choice: the stop string that ended it, or the id of the request's
    `stop_token_ids` token that did; None when it ended otherwise (the model's own end token included)."""
    if result.stop_string is not None:
        return result.stop_string
    why = result.stop_reason or ""
    token = int(why[6:]) if why.startswith("token:") else None
    return token if token is not None and token in stop_token_ids else None


def usage(results: list[Result], n: int = 1, reasoning_tokens: int | None = None) -> dict:
    """Usage of one response. `results` come prompt by prompt, `n` choices each: a prompt (and the
    part of it the prefix cache held, OpenAI's `prompt_tokens_details.cached_tokens`) counts once.
    `reasoning_tokens`: a thinking model's (`kvgate.server.reasoning`), in `completion_tokens_details`."""
    prompts = results[::n]
    prompt = sum(r.prompt_tokens for r in prompts)
    completion = sum(r.completion_tokens for r in results)
    cap = next((r.budget_cap for r in results if r.budget_cap is not None), None)
    predicted = [r.prediction_tokens for r in results if r.prediction_tokens is not None]
    details = {}
    if predicted:  # the request sent a `prediction` (kvgate.core.predicted)
        details["completion_tokens_details"] = {
            "accepted_prediction_tokens": sum(a for a, _ in predicted),
            "rejected_prediction_tokens": sum(r for _, r in predicted),
        }
    if reasoning_tokens is not None:
        details.setdefault("completion_tokens_details", {})["reasoning_tokens"] = reasoning_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(r.cached_tokens for r in prompts)},
        **details,
        "budget_cap": None
        if cap is None
        else {
            "requested_max_tokens": cap.requested_max_tokens,
            "admitted_max_tokens": cap.admitted_max_tokens,
            "reason": cap.reason,
        },
    }


def completion_body(
    kind: str, rid: str, created: int, model: str, results: list[Result], n: int = 1, stop_ids=()
) -> dict:
    """`stop_ids`: the request's `stop_token_ids` (for `stop_reason`)."""
    payload = "message" if kind == "chat" else "text"
    choices = [
        {
            "index": i,
            payload: {"role": "assistant", "content": r.text} if kind == "chat" else r.text,
            "finish_reason": finish_reason(r.finish_reason),
            "stop_reason": stop_reason(r, stop_ids),
            "logprobs": None,
        }
        for i, r in enumerate(results)
    ]
    return {
        "id": rid,
        "object": "chat.completion" if kind == "chat" else "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage(results, n),
    }


class ChunkMaker:
    """The `data:` objects of one stream (same id, object, created and model on every chunk)."""

    def __init__(self, kind: str, rid: str, created: int, model: str, n: int = 1):
        self.kind = kind
        self.n = n
        self.base = {
            "id": rid,
            "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
            "created": created,
            "model": model,
        }

    def choice(self, i: int, text: str | None = None, finish: str | None = None, role: bool = False) -> dict:
        if self.kind == "chat":
            delta: dict = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice = {"index": i, "delta": delta, "finish_reason": finish}
        else:
            choice = {"index": i, "text": text or "", "finish_reason": finish, "logprobs": None}
        return {**self.base, "choices": [choice]}

    def finish(self, i: int, reason: str, stop: str | int | None = None) -> dict:
        """`stop`: the choice's `stop_reason` (vLLM's field, on its finish chunk)."""
        chunk = self.choice(i, None if self.kind == "chat" else "", finish=finish_reason(reason))
        chunk["choices"][0]["stop_reason"] = stop
        return chunk

    def usage(self, results: list[Result], reasoning_tokens: int | None = None) -> dict:
        return {**self.base, "choices": [], "usage": usage(results, self.n, reasoning_tokens)}
