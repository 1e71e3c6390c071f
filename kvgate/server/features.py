"""What a request asks beyond plain sampling: structured output, tools, logprobs, logit bias, echo.

`features_of(engine, req)` runs in prepare's worker thread (never on the event loop) and returns a
`Features` value: the grammar (compiled here, once per distinct grammar, and cached by its text), the
tool plan, how many top logprobs each token carries, the logit bias by token id, and the echo prefix.
Every refusal is a 400 naming the field: a schema the grammar engine cannot compile names the
construct (`Unimplemented keys: ["not"]`), a logprobs count out of range names the range.

`response_format` `json_object` is any JSON object; `json_schema` is that schema (OpenAI's `strict`
changes nothing here: every schema is enforced). JSON is generated compact with ", " and ": "
separators: a small model under a grammar that allows free whitespace can emit whitespace forever.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from kvgate.sampling import MAX_TOP_LOGPROBS
from kvgate.server import mistral_tools as MT
from kvgate.server import protocol as P
from kvgate.server import tools as T
from kvgate.server.chat_messages import chat_messages
from kvgate.server.errors import APIError, invalid, unsupported
from kvgate.server.guided import check_counts, constraint_of, guided_error, lark_of
from kvgate.server.reasoning import Reasoning, wrap_grammar
from kvgate.structured.compiler import Grammar, GrammarError, check_lengths, compiler_for
from kvgate.structured.schema_prep import (
    compiles,
    grammar_schema,
    keyword_paths,
    length_bounds,
    unimplemented,
)

MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for the legacy completions endpoint


@dataclass
class Features:
    grammar: Grammar | None = None
    tools: T.ToolPlan | None = None
    logprobs: int | None = None  # None: no logprobs in the response; k: the top k with each token
    logit_bias: dict[int, float] | None = None
    echo: bool = False  # with logprobs: the prompt is scored too (`GenerationRequest.prompt_logprobs`)

    @property
    def scores_prompt(self) -> bool:
        return self.echo and self.logprobs is not None


def features_of(engine, req, think: Reasoning | None = None) -> Features:
    """`think`: the request's reasoning plan; a grammar then constrains only what follows the reasoning
    (`kvgate.server.reasoning.wrap_grammar`)."""
    f = Features()
    chat = isinstance(req, P.ChatCompletionRequest)
    f.tools = T.plan_tools(req) if chat else None
    f.logprobs = _logprobs(req, chat)
    f.logit_bias = _logit_bias(req)
    f.echo = bool(getattr(req, "echo", False))
    if f.echo and f.logprobs is not None and req.stream:
        raise unsupported(
            "echo",
            "echo with logprobs (the prompt's log-probabilities) is answered whole, not streamed: "
            "send stream=false",
        )
    # the most characters this output can have (its tokens times the longest token's bytes): a maxLength
    # at or past it cannot bind, and is dropped (lexer states are planned memory: `check_lengths`)
    limit = P.max_tokens_of(req)[0]
    tokens = (
        min(limit, engine.max_model_len) if isinstance(limit, int) and limit > 0 else engine.max_model_len
    )
    per_token = engine.tokenizer.longest_token_bytes()
    reach = tokens * per_token
    answer = _answer_rule(req.response_format, reach)
    guided = constraint_of(req)  # vLLM's structured_outputs / guided_*, llama.cpp's json_schema / grammar
    if guided is not None and (answer is not None or f.tools is not None):
        other = "tools" if f.tools is not None else "response_format"
        raise invalid(
            f"{guided.param} and {other} each constrain the output: send only one of them", param=guided.param
        )
    if f.tools is not None:
        # Llama 3.x's bare call where its template asks for it, never beside an answer format (the
        # parser and the stop strings read `bare` too); Qwen's tags as their own tokens
        f.tools.mistral = MT.mistral_format(engine.tokenizer)  # Mistral's own `[TOOL_CALLS]` calls
        f.tools.formatted = answer is not None
        if f.tools.mistral is not None:
            MT.check_names(f.tools)
            text = MT.grammar(f.tools, answer, reach)
        else:
            f.tools.bare = answer is None and T.asks_bare(engine.tokenizer)
            text = T.grammar(f.tools, answer, reach, T.tag_ids(engine.tokenizer))
    elif answer is not None:
        text = f"start: {answer}\n"
    elif guided is not None:
        text = lark_of(guided, T.JSON_STYLE, reach)
    else:
        return f
    if think is not None:
        think.grammar = True
        text = wrap_grammar(text, think)
    if getattr(req, "min_tokens", None):  # a grammar that allows only its end could then go nowhere
        raise unsupported(
            "min_tokens",
            "min_tokens together with response_format or tools is not implemented (a grammar decides where "
            "its answer ends); send the request without one of them",
        )
    if engine.plan.limits.grammars < 1:  # before the compiler: its token trie is not in such a plan
        param = "tools" if f.tools is not None else guided.param if guided is not None else "response_format"
        raise APIError(
            400,
            "structured output is off on this server: it was started with --max-grammars 0, which plans no "
            f"memory for grammars. Send the request without {param}, or ask the operator for --max-grammars "
            "1 or more",
            "structured_output_off",
            param=param,
        )
    compiler = compiler_for(engine.tokenizer, engine.spec.vocab_size, engine.plan.limits.grammars)
    schemas = [fn.parameters for fn in f.tools.functions] if f.tools is not None else []
    if req.response_format is not None and req.response_format.json_schema is not None:
        schemas.append(req.response_format.json_schema.schema_)
    if guided is not None and guided.kind == "json":
        schemas.append(guided.value)
    try:
        check_lengths([b for s in schemas for b in length_bounds(s, reach)], per_token)
        if guided is not None:
            check_counts(guided)
        f.grammar = compiler.check(text)
    except GrammarError as exc:
        if guided is not None:
            raise guided_error(guided, str(exc)) from None
        raise _unenforceable(req, f.tools, str(exc)) from None
    return f


def _unenforceable(req, plan: T.ToolPlan | None, why: str) -> APIError:
    """The 400 for a schema the engine refused, naming the tool (of maybe dozens) and the keyword's
    paths in it, with the way out for the keyword pydantic writes for `set[...]` fields."""
    param, what, schema = "response_format", "this JSON schema", None
    if req.response_format is not None and req.response_format.json_schema is not None:
        schema = req.response_format.json_schema.schema_
    if plan is not None:
        if schema is None:
            param, what = "tools", "the tools' parameters"
        names = [t.function.name for t in req.tools]
        for fn in plan.functions:
            if not compiles(T.args_schema(fn)):
                i = names.index(fn.name)
                param, what, schema = (
                    f"tools.{i}.function.parameters",
                    f"tool {fn.name!r}'s parameters",
                    fn.parameters,
                )
                break
    keys = unimplemented(why)
    paths = keyword_paths(schema, keys) if schema is not None else []
    where = f" (at {', '.join(paths[:4])})" if paths else ""
    hint = (
        "; pydantic writes uniqueItems for set[...] fields: use list[...], or drop uniqueItems"
        if "uniqueItems" in keys
        else ""
    )
    return APIError(400, f"{what} cannot be enforced: {why}{where}{hint}", "unsupported_schema", param=param)


def _answer_rule(rf: P.ResponseFormat | None, reach: int | None = None) -> str | None:
    """The Lark rule body for a non-tool answer, or None for free text."""
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        schema: dict = {"type": "object", "x-guidance": T.JSON_STYLE}
    else:
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise invalid(
                "response_format of type 'json_schema' needs json_schema.schema", param="response_format"
            )
        schema = grammar_schema(rf.json_schema.schema_, T.JSON_STYLE, reach)
    return "%json " + json.dumps(schema, ensure_ascii=False)


def _logprobs(req, chat: bool) -> int | None:
    lp, top = req.logprobs, req.top_logprobs
    if chat:
        if isinstance(lp, int) and not isinstance(lp, bool):
            raise invalid(
                "logprobs is a boolean for chat completions (top_logprobs says how many)", "logprobs"
            )
        if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
            raise invalid(f"top_logprobs={top} must be between 0 and {MAX_TOP_LOGPROBS}", "top_logprobs")
        if top and not lp:
            raise invalid("top_logprobs needs logprobs=true", "top_logprobs")
        return (top or 0) if lp else None
    if top is not None:
        raise unsupported(
            "top_logprobs",
            "the completions endpoint takes logprobs as an integer (logprobs: 5 for the top 5)",
        )
    if lp is None or lp is False:
        return None
    if isinstance(lp, bool) or not 0 <= lp <= MAX_COMPLETION_LOGPROBS:
        raise invalid(
            f"logprobs={lp!r} must be an integer between 0 and {MAX_COMPLETION_LOGPROBS}", "logprobs"
        )
    return lp


def _logit_bias(req) -> dict[int, float] | None:
    if not req.logit_bias:
        return None
    out = {}
    for k, v in req.logit_bias.items():
        if not k.isdigit():
            raise invalid(f"logit_bias keys are token ids; {k!r} is not one", param="logit_bias")
        out[int(k)] = v
    return out


def render_chat(
    engine, req: P.ChatCompletionRequest, plan: T.ToolPlan | None
) -> tuple[list[dict], list | None]:
    """The messages (and `tools`, for templates that take them) to give the chat template."""
    return T.render(chat_messages(req), plan, engine.tokenizer.supports_tools)
