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

from dataclasses import dataclass, field

from kvgate.request import GenerationRequest, RequestError, check_max_tokens, check_token_ids
from kvgate.sampling import SamplingError, SamplingParams
from kvgate.server import generation_defaults
from kvgate.server import protocol as P
from kvgate.server import reasoning as R
from kvgate.server.bodies import parse_json
from kvgate.server.chat_template import template_options
from kvgate.server.context import ServerSettings, check_model
from kvgate.server.errors import APIError, invalid
from kvgate.server.features import Features, features_of, render_chat
from kvgate.server.logprob_body import dict_hold_bytes
from kvgate.server.tools import plan_tools, stop_regions
from kvgate.server.vllm_extras import bad_word_ids, truncated
from kvgate.tokenizer import ChatTemplateError


@dataclass
class Prepared:
    kind: str  # "chat" | "completion"
    request: P.ChatCompletionRequest | P.CompletionRequest
    generations: list[GenerationRequest]
    features: Features = field(default_factory=Features)  # structured output, tools, logprobs, echo
    prompt_only: bool = False  # echo with max_tokens=0: the response holds the prompt, nothing generated
    truncated: frozenset = frozenset()  # prompts truncate_prompt_tokens cut: echo shows what was kept
    # which text completion choices carry return_token_ids' prompt ids: "all", "first" or "none" (a
    # route that rewrites the answer and needs them once, or not at all: kvgate.server.generate_route)
    prompt_ids_out: str = "all"
    reasoning: R.Reasoning | None = None  # a chat answer's think block, split off (kvgate.server.reasoning)

    @property
    def n(self) -> int:
        """Choices per prompt (OpenAI's `n`)."""
        return self.request.n or 1

    @property
    def candidates(self) -> int:
        """Choices generated per prompt: `best_of` of them, the `n` most likely returned."""
        return max(self.n, getattr(self.request, "best_of", None) or 1)

    @property
    def field_names(self) -> dict[str, str]:
        """The request's own names for the fields a refusal can point at (`errors.from_refusal`)."""
        best_of = getattr(self.request, "best_of", None) or 1
        return {
            "prompt": "messages" if self.kind == "chat" else "prompt",
            "max_tokens": P.max_tokens_of(self.request)[1],
            "n": "best_of" if best_of > self.n else "n",
        }

    @property
    def stream(self) -> bool:
        return self.request.stream

    @property
    def include_usage(self) -> bool:
        opts = self.request.stream_options
        return bool(opts and opts.include_usage)


def prepare_generation(
    raw: bytes, cls, engine, settings: ServerSettings, whole: bool = False, hold=None
) -> Prepared:
    """`whole`: the caller builds its own body from this one's dicts (`hold(k)` a position, default
    `dict_hold_bytes`)."""
    req = P.parse(cls, parse_json(raw))
    P.check_common(req)
    if isinstance(req, P.CompletionRequest):
        P.check_completion(req)
    check_model(settings, req.model)
    think, sent = reasoning_of(engine, req, settings)
    feats = features_of(engine, req, think)
    check_prompt_count(engine, req)
    max_tokens, param = P.max_tokens_of(req)
    sent = sent or prompt_ids(engine, req, feats)
    prompts = truncated(sent, req.truncate_prompt_tokens, max_tokens, engine.max_model_len)
    model = generation_defaults.of(engine, settings)  # the model's own, for fields left out
    sampling = SamplingParams(
        temperature=model.get("temperature", settings.default_temperature)
        if req.temperature is None
        else req.temperature,
        top_p=model.get("top_p", 1.0) if req.top_p is None else req.top_p,
        top_k=model.get("top_k", 0) if req.top_k is None else req.top_k,
        min_p=model.get("min_p", 0.0) if req.min_p is None else req.min_p,
        repetition_penalty=model.get("repetition_penalty", 1.0)
        if req.repetition_penalty is None
        else req.repetition_penalty,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        seed=req.seed,
        logit_bias=feats.logit_bias,
        # best_of > n ranks candidates by their summed log-probability: each token's is needed
        logprobs=0
        if feats.logprobs is None and (getattr(req, "best_of", None) or 1) > (req.n or 1)
        else feats.logprobs,
        grammar=feats.grammar,
        allowed_token_ids=req.allowed_token_ids,
        bad_words=bad_word_ids(engine.tokenizer, req.bad_words),
    )
    try:
        sampling.check_vocab(engine.spec.vocab_size)
        sampling.pack()  # the allowed ids as a bitmask: the list as sent (up to a body's size) is let go
    except SamplingError as exc:
        raise invalid(str(exc), param=exc.param) from None
    req.allowed_token_ids = None
    if feats.logprobs is not None:
        engine.tokenizer.token_bytes(0)  # builds the token-bytes table here, off the event loop
    # echo with max_tokens=0 scores the prompt alone (the field's way to ask for a text's log-likelihood):
    # the engine reserves and samples one token, which the response leaves out
    prompt_only = feats.echo and max_tokens == 0
    if prompt_only:
        max_tokens = 1
    predicted = prediction_ids(engine, req)
    gens = [
        GenerationRequest(
            ids,
            sampling,
            max_tokens,
            P.stop_list(req),
            list(req.stop_token_ids or []),
            req.ignore_eos,
            min_tokens=req.min_tokens or 0,
            prompt_logprobs=feats.logprobs if feats.scores_prompt else None,
            prediction_ids=predicted,
            skip_special_tokens=req.skip_special_tokens,
            keep_special=kept_tokens(feats, think),
            include_stop_str=req.include_stop_str_in_output,
            report_stop_token=req.return_token_ids or req.return_tokens_as_token_ids,
            cache_salt=req.cache_salt,
            stop_exempt=stop_regions(feats.tools),
            # the server keeps a response's logprobs until it is sent (kvgate.server.held)
            held=(hold or dict_hold_bytes)(feats.logprobs) if whole else 0,
        )
        for ids in prompts
    ]
    try:
        check_max_tokens(max_tokens, param)
    except RequestError as exc:
        raise invalid(str(exc), param=exc.param) from None
    if prompt_only and req.min_tokens:  # QA pass 15: accepted, or told "max_tokens=1" it never sent
        raise invalid(
            "min_tokens with max_tokens=0 and echo: that answer is the prompt's scores alone, with no "
            "generated tokens to hold back a stop from; drop min_tokens",
            param="min_tokens",
        )
    if prompt_only and req.stream:
        raise invalid(
            "max_tokens=0 with echo returns the prompt alone: send stream=false", param="max_tokens"
        )
    L = engine.max_model_len
    if prompt_only and any(len(ids) >= L for ids in prompts):
        P_len = max(len(ids) for ids in prompts)
        raise invalid(
            f"max_tokens=0 with echo still reserves one position past the prompt: the prompt is {P_len} "
            f"tokens and the context holds {L} (--max-model-len); send at most {L - 1} tokens",
            param="prompt",
        )
    return Prepared(
        P.request_kind(req),
        req,
        gens,
        feats,
        prompt_only,
        truncated=frozenset(k for k, (a, b) in enumerate(zip(prompts, sent)) if a != b),
        reasoning=think,
    )


def kept_tokens(feats: Features, think: R.Reasoning | None) -> frozenset[int]:
    """The control tokens the detokenizer writes for this request: Mistral's `[TOOL_CALLS]` (and
    `[ARGS]`, `[CALL_ID]`) for its tool parser, `[THINK]` and `[/THINK]` for its reasoning splitter."""
    tools = (
        feats.tools.mistral.kept
        if feats.tools is not None and feats.tools.mistral is not None
        else frozenset()
    )
    return tools | (think.kept if think is not None else frozenset())


def reasoning_of(engine, req, settings: ServerSettings) -> tuple[R.Reasoning | None, list | None]:
    """A chat request's reasoning plan under `--reasoning-parser` (None when off), and its prompt, which
    the plan reads (where it ends says whether the think block is open) and prepare then uses."""
    if (
        not isinstance(req, P.ChatCompletionRequest)
        or R.resolve(settings.reasoning_parser, engine.tokenizer) is None
    ):
        return None, None
    sent = prompt_ids(engine, req, Features(tools=plan_tools(req)))
    return R.plan(settings.reasoning_parser, engine, req, sent[0]), sent


def prediction_ids(engine, req) -> list[int] | None:
    """The tokens of a chat request's `prediction` (kvgate.core.predicted), or None without one."""
    pred = getattr(req, "prediction", None)
    if pred is None:
        return None
    ids = engine.tokenizer.encode(pred.text(), add_bos=False)
    L = engine.max_model_len
    if len(ids) > L:
        raise invalid(
            f"prediction is {len(ids)} tokens, more than the model's whole context of {L} positions, "
            f"which also holds the prompt: send at most the text you expect back (under {L} tokens)",
            param="prediction",
        )
    return ids


def submit_all(engine, generations: list[GenerationRequest], n: int = 1) -> list:
    """Submit every prompt (`n` choices each) or none (`Engine.submit_many`); an invalid field is a
    400 naming it. Handles come prompt by prompt, choice by choice: OpenAI's choice index order."""
    try:
        return engine.submit_many(generations, n)
    except (RequestError, SamplingError) as exc:
        raise invalid(str(exc), param=exc.param) from None


def check_prompt_count(engine, req) -> None:
    """A list of prompts is one request whose answers come together, so all its rows run at once: more
    than `--max-seqs` rows can never be admitted (refused before any prompt is tokenized: QA pass 9 sent
    a 4 MB body of a million one-letter prompts, and tokenizing them took 420 MiB over the plan)."""
    p = getattr(req, "prompt", None)
    count = len(p) if isinstance(p, list) and p and not isinstance(p[0], int) else 1
    choices = max(req.n or 1, getattr(req, "best_of", None) or 1)
    rows = engine.sched_cfg.max_seqs
    if count > 1 and count * choices > rows:
        raise APIError(
            400,
            f"this request's {count:,} prompts x {choices} choice{'s' if choices > 1 else ''} run as "
            f"{count * choices:,} batch rows at once (their answers come together), and this server runs "
            f"at most {rows} (--max-seqs). Send at most {max(1, rows // choices)} prompts a request, or "
            "several requests.",
            "too_many_choices",
            param="prompt",
        )


def prompt_ids(engine, req, feats: Features | None = None) -> list[list[int]]:
    tok = engine.tokenizer
    if isinstance(req, P.ChatCompletionRequest):
        return [chat_ids(engine, *render_chat(engine, req, feats.tools if feats else None), req)]
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


def chat_ids(engine, messages: list[dict], tools, req) -> list[int]:
    """The prompt of `req`'s rendered `messages` (and `tools`), by its template fields."""
    o = template_options(req, req.messages)
    try:
        return engine.tokenizer.chat_ids(messages, tools, o.add_generation_prompt, o.continue_final, o.kwargs)
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
    if req.messages is None and (req.tools or req.tool_choice is not None):
        raise invalid(
            "'tools' and 'tool_choice' go with 'messages' (a chat's prompt), not 'prompt'", param="tools"
        )
    if req.messages is not None:
        chat = P.ChatCompletionRequest(messages=req.messages, tools=req.tools, tool_choice=req.tool_choice)
        ids = chat_ids(engine, *render_chat(engine, chat, plan_tools(chat)), req)  # exactly the chat's prompt
    else:
        ids = engine.tokenizer.encode(req.prompt, add_bos=None if req.add_special_tokens else False)
    out = {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}
    if req.return_token_strs:  # vLLM's `convert_ids_to_tokens`: the vocabulary's strings ("Ġhello")
        out["token_strs"] = [engine.tokenizer.token_text(i) for i in ids]
    return out


def prepare_detokenize(raw: bytes, engine, settings: ServerSettings) -> dict:
    req = P.parse(P.DetokenizeRequest, parse_json(raw))
    check_model(settings, req.model)
    check_ids(engine, req.tokens, "tokens")
    return {"prompt": engine.tokenizer.decode(req.tokens, skip_special_tokens=False)}
