"""Tool calling: render tools and tool turns into the prompt, constrain calls by grammar, parse them back.

The call format is Hermes's (Qwen2.5's and Qwen3's chat templates use it), one block per call:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

or Llama 3.x's (its chat templates ask for it, vLLM's `llama3_json` parser reads it): the whole output
is one bare call, `{"name": "get_weather", "parameters": {"city": "Paris"}}` (`"arguments"` is taken
too). The bare form is offered only where the template asks for it (`asks_bare`: a template that reads
`tools`, mentions `"parameters"` and not `<tool_call>`) and no answer format is set
(`response_format`): then `ToolPlan.bare` is set, the grammar has the bare branch, a free-text answer
never starts with `{"name": ` (`BARE`), the parser reads a bare call of a declared function, and
stop strings do not apply inside one (`stop_regions`). Every other model (SmolLM2's and Qwen's
templates) gets the Hermes blocks alone. Where the vocabulary has `<tool_call>` and `</tool_call>` as
added tokens (Qwen2.5/Qwen3), the grammar takes each as its token as well as its text (`tag_ids`).
A Mistral model (its template writes `[TOOL_CALLS]`, its vocabulary has the token) gets its own format
instead, grammar and parser from kvgate/server/mistral_tools.py (`ToolPlan.mistral`).

Rendering: a chat template that reads `tools` gets them (OpenAI's list) and the turns as Hugging Face
templates expect them (an assistant turn's `tool_calls` with `arguments` as an object, `{}` when
they are not JSON, as vLLM passes them; `tool` turns as they are). Any other template (SmolLM2's
among them) gets the documented generic preamble below as
(the end of) the system message, assistant tool calls written as the blocks above, and each tool
answer as a user turn inside `<tool_response>` tags: roles every template accepts.

Generation: with `tool_choice` `auto` the grammar is `answer | calls`, with `required` or a named
function `calls` only; `calls` is one block, or with `parallel_tool_calls` (the default) one or more,
each after the first opened by newlines and `<tool_call>` together. Each block is `{"name": NAME,
"arguments": ARGS}` with ARGS generated under that function's JSON schema (`%json`), so arguments
always parse and validate; a bare call (one, alone: Llama's templates replay one call a turn) is
`{"name": NAME, "parameters": ARGS}` under the same schema. An answer is any text in which
`<tool_call>` does not occur (and, in bare mode, which does not start with `BARE`); under `auto`
the calls may also follow some text in the same turn (as Hermes models write "Let me check." before a
call, and as kvgate renders a replayed turn with both), which is the message's content beside its
`tool_calls`. After the calls, a newline that `<tool_call>` does not follow starts a short remark that
ends the output and is dropped (`grammar` says why neither side may commit on one character). `none`
renders no tools and uses no grammar.

`ToolCallParser` (kvgate/server/tool_parser.py) reads the output incrementally (the same code for
streams and whole responses): it releases content, each call's start (id, name) and its arguments as they are generated, holding back
only what could still be the start of a block. It follows the arguments' JSON, so it knows each
character for an argument's or the wrapper's the moment it comes: the wrapper's markup never reaches
the client. An output cut short (max_tokens) inside a call ends with that call and the argument text
generated so far (finish_reason `length`, as OpenAI gives it), or, when the cut came before the
call's name was whole, with no call and no content.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from kvgate.server import protocol as P
from kvgate.server.errors import invalid
from kvgate.structured.schema_prep import grammar_schema

OPEN = "<tool_call>\n"
END = "</tool_call>"
CLOSE = "}\n" + END
SEP = "\n"
ARGS_AT = ', "arguments": '
BARE = '{"name": '  # opens a bare call: an output that starts with it is one
BARE_KEYS = (', "parameters": ', ARGS_AT)  # a bare call's arguments key: Llama's, or Hermes's
CALL_REGION = (OPEN.rstrip(), END)  # where the request's stop strings do not apply (kvgate.stop)
BARE_REGION = (BARE, None)  # a bare call: from its opening to the end of its JSON object (kvgate.stop)
TAIL_CHARS = 16  # a remark after the calls: the model may start one, and the output ends within it
MISTRAL_MARK = "[TOOL_CALLS]"  # Mistral's control token that opens its calls (kvgate.server.mistral_tools)
# Mistral's calls run to the output's end: a closing that never comes (JSON never holds a raw NUL)
MISTRAL_REGION = (MISTRAL_MARK, "\x00")
MISTRAL_LEAD_REGION = (*MISTRAL_REGION, "start")  # beside an answer format: at the answer's start only

PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass
class ToolPlan:
    mode: str  # "auto" | "required" | "named"
    functions: list[P.FunctionDef]
    parallel: bool
    bare: bool = False  # Llama 3.x's bare call is offered (`asks_bare`, and no response_format)
    mistral: object = None  # the model's `mistral_tools.MistralFormat`: its calls, not Hermes blocks
    formatted: bool = False  # an answer format beside the tools (`answer | calls`: calls come first)

    @property
    def bare_names(self) -> frozenset[str]:
        """The names a bare call may have (`ToolCallParser`'s flag): none unless bare calls are offered."""
        return frozenset(f.name for f in self.functions) if self.bare else frozenset()


def asks_bare(tok) -> bool:
    """Whether the model's chat template asks for Llama 3.x's bare calls: it reads `tools` and shows
    `"parameters"` as the call's key, and it is no Hermes template (those write `<tool_call>`; Hermes
    2 Pro/3 write `"parameters"` in their tool list too)."""
    template = getattr(getattr(tok, "info", None), "chat_template", None) or ""
    return (
        bool(getattr(tok, "supports_tools", False))
        and '"parameters"' in template
        and OPEN.rstrip() not in template
    )


def tag_ids(tok) -> tuple[int | None, int | None]:
    """The ids of `<tool_call>` and `</tool_call>` where the vocabulary has them as added tokens that
    the detokenizer writes as text (not special: Qwen2.5's and Qwen3's), else None. llguidance never
    matches an added token against literal text, so the grammar names them by id (`<[id]>`)."""
    vocab = getattr(tok, "tok", None)
    added = vocab.get_added_tokens_decoder() if vocab is not None else {}
    ids = {a.content: i for i, a in added.items() if not a.special}
    return ids.get(OPEN.rstrip()), ids.get(END)


def stop_regions(plan: ToolPlan | None):
    """The output regions a request's stop strings do not apply in (`GenerationRequest.stop_exempt`)."""
    if plan is None:
        return None
    if plan.mistral is not None:
        return MISTRAL_LEAD_REGION if plan.formatted else MISTRAL_REGION
    return (CALL_REGION, BARE_REGION) if plan.bare else CALL_REGION


def plan_tools(req: P.ChatCompletionRequest) -> ToolPlan | None:
    """What the request asks of tools, or None when no call may be made."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise invalid("tool_choice needs 'tools' to choose from", param="tool_choice")
        return None
    names = [t.function.name for t in req.tools]
    if len(set(names)) != len(names):
        raise invalid("two tools have the same function name", param="tools")
    for i, t in enumerate(req.tools):
        kind = (t.function.parameters or {}).get("type", "object")
        if kind != "object" and not (isinstance(kind, list) and "object" in kind):
            raise invalid(
                f"tool {t.function.name!r}'s parameters are a JSON schema of type {json.dumps(kind)}; a "
                'call\'s arguments are one JSON object, so parameters must be {"type": "object", ...} '
                "(as OpenAI requires): wrap the value in a property",
                param=f"tools.{i}.function.parameters",
            )
    if choice == "none":
        return None
    if isinstance(choice, P.NamedToolChoice):
        chosen = [t.function for t in req.tools if t.function.name == choice.function.name]
        if not chosen:
            raise invalid(
                f"tool_choice names function {choice.function.name!r}, which is not among the tools",
                param="tool_choice",
            )
        return ToolPlan("named", chosen, False)
    parallel = req.parallel_tool_calls is not False
    return ToolPlan(choice or "auto", [t.function for t in req.tools], parallel)


def tool_list(functions: list[P.FunctionDef]) -> list[dict]:
    return [{"type": "function", "function": f.model_dump(exclude_none=True)} for f in functions]


def template_tools(functions: list[P.FunctionDef]) -> list[dict]:
    """The `tools` a chat template reads, as vLLM passes them (its `FunctionDefinition.model_dump()`):
    `description` and `parameters` always there, None when the request left them out, `strict` only
    when sent. Templates that write `tool.description | tojson` (Command R7B's, Cohere2's) or read
    `tool.parameters` (Hermes 2 Pro's and 3's tool_use) failed on a tool without them: a 400 from
    kvgate (and transformers) where vLLM renders `null`."""
    out = []
    for f in functions:
        fn = {"name": f.name, "description": f.description, "parameters": f.parameters}
        if f.strict is not None:
            fn["strict"] = f.strict
        out.append({"type": "function", "function": fn})
    return out


def render(messages: list[dict], plan: ToolPlan | None, native: bool) -> tuple[list[dict], list | None]:
    """Messages for the chat template, and the `tools` to pass it (native templates only)."""
    if native:
        out = [_native_turn(m) for m in messages]
        return out, template_tools(plan.functions) if plan else None
    out: list[dict] = []
    for m in messages:
        if m["role"] == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("_tool_answers"):  # answers to one turn's calls go together
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_answers": True})
        elif m.get("tool_calls"):
            # a call cut before its arguments (kvgate's own `length` answer) replays as `{}`: the model is
            # never shown `"arguments": }` as an example of its format
            blocks = [
                _block(c["function"]["name"], _json_text(c["function"]["arguments"])) for c in m["tool_calls"]
            ]
            text = SEP.join(blocks)
            out.append({"role": "assistant", "content": (m["content"] + "\n" if m["content"] else "") + text})
        else:
            out.append({k: v for k, v in m.items() if k != "tool_call_id"})
    for m in out:
        m.pop("_tool_answers", None)
    if plan is not None:
        pre = PREAMBLE.format(
            tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tool_list(plan.functions))
        )
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + pre}
        else:
            out.insert(0, {"role": "system", "content": pre})
    return out, None


def _block(name: str, arguments: str) -> str:
    return f'{OPEN}{{"name": {json.dumps(name, ensure_ascii=False)}{ARGS_AT}{arguments}{CLOSE}'


def _json_text(arguments: str) -> str:
    """A replayed call's arguments, or `{}` when they are not JSON (a call kvgate returned cut short by
    max_tokens): the model is never shown a broken call as an example of its format (QA pass 6)."""
    try:
        json.loads(arguments)
        return arguments
    except json.JSONDecodeError:
        return "{}"


def _native_turn(m: dict) -> dict:
    """Arguments as the object they stand for, as vLLM passes them (`chat_utils._postprocess_messages`):
    templates iterate them (`| items`) or write them with `| tojson`; a string there would be quoted."""
    if not m.get("tool_calls"):
        return m
    calls = []
    for c in m["tool_calls"]:
        args = json.loads(_json_text(c["function"]["arguments"]))
        calls.append({**c, "function": {"name": c["function"]["name"], "arguments": args}})
    return {**m, "tool_calls": calls}


def args_schema(f: P.FunctionDef, reach: int | None = None) -> dict:
    # no parameters: the function takes none (an empty object, not any object)
    if f.parameters:
        return grammar_schema(f.parameters, JSON_STYLE, reach)
    return {"type": "object", "properties": {}, "additionalProperties": False, "x-guidance": JSON_STYLE}


def not_containing(word: str) -> str:
    """A regex (no lookahead: llguidance's lexer has none) for the non-empty texts in which `word`
    never occurs, for a word whose first character occurs nowhere else in it (`<tool_call>`): each
    such character starts a piece, the character and a proper prefix of the rest, that ends where the
    text parts from the word, at another first character, or at the text's end."""
    first, rest = word[0], word[1:]
    assert first not in rest, word
    f = re.escape(first)
    prefix = "(" + "|".join(re.escape(rest[:j]) for j in range(1, len(rest))) + ")?"
    piece = f"{f}{prefix}"
    parts = "|".join(f"{f}{re.escape(rest[:j])}[^{f}{re.escape(rest[j])}]" for j in range(len(rest)))
    unit = f"[^{f}]|({piece})*({parts})"
    return f"({unit})+({piece})*|({piece})+"


def grammar(
    plan: ToolPlan, answer_rule: str | None, reach: int | None = None, tags: tuple = (None, None)
) -> str:
    """llguidance Lark text: `answer_rule` (a rule body, or None for free text) or the calls.

    Neither side commits on one character the model also writes in text: an answer may hold anything
    but the whole `<tool_call>` (HTML, or the `<tool_response>` a small model echoes after a tool's
    answer, are answers), and a `<tool_call>` after some text opens calls whose arguments are held
    to their schemas as everywhere (QA pass 9: it was free text, markup and all, returned as content
    with finish_reason `stop`). After a call a newline commits to another call only when
    `<tool_call>` follows it; else the newline starts a remark of at most TAIL_CHARS that ends the
    output (the parser drops it). A separator that was one newline forced a model that meant
    "\n\nThe function returns ..." into a second call, which it copied from the first.
    `tags`: the ids of `<tool_call>` and `</tool_call>` as added tokens (`tag_ids`), each then taken as
    its token or its text. With `plan.bare` (never with `answer_rule`: llguidance commits to a bare
    call on `{"` of a JSON answer, session 47's review) one bare call may be the whole output, and a
    free-text answer never starts with the whole `BARE`: those nine characters open a bare call."""
    lines = []
    more = " next*" if plan.parallel else ""
    bare = plan.bare and not answer_rule
    opens, ends = _either(OPEN, OPEN.rstrip(), tags[0]), _either(CLOSE, END, tags[1])
    if plan.mode == "auto" and answer_rule:
        lines.append("start: answer | calls")
        lines.append(f"answer: {answer_rule}")
    elif plan.mode == "auto":  # free text, calls, or text and then calls (LEAD holds the first opening)
        lines.append("start: answer | calls | lead" + (" | bare" if bare else ""))
        text = not_containing(OPEN.rstrip())
        not_bare = f" & ~/{_BARE_RE}[\\s\\S]*/" if bare else ""
        lines += ["answer: TEXT", f"TEXT: /{text}/{not_bare}"]
        lead = "LEAD" if tags[0] is None else f"(LEAD | TEXT <[{tags[0]}]> {json.dumps(SEP)})"
        lines.append(f"lead: {lead} body{more} TAIL?")
        lines.append(f"LEAD: /({text}){re.escape(OPEN.rstrip())}\\n/{not_bare}")
    else:
        lines.append("start: calls" + (" | bare" if bare else ""))
    lines.append(f"calls: call{more} TAIL?")
    if plan.parallel:  # blank lines may part two calls, as they may end the calls
        lines.append(f"TAIL: /\\n+([^<\\n][\\s\\S]{{0,{TAIL_CHARS - 1}}})?/")
        lines.append("NEWLINES: /\\n+/")
    else:
        lines.append(f"TAIL: /\\n[\\s\\S]{{0,{TAIL_CHARS}}}/")
    alts = " | ".join(f"fn_{i}" for i in range(len(plan.functions)))
    lines.append(f"body: ({alts}) {ends}")
    lines.append(f"call: {opens} body")
    if plan.parallel:
        lines.append(f"next: NEWLINES {opens} body")
    if bare:
        alts = " | ".join(f"bare_{i}" for i in range(len(plan.functions)))
        lines.append(f'bare: ({alts}) "}}" TAIL?')
        lines.append("bare_key: " + " | ".join(json.dumps(k[2:]) for k in BARE_KEYS))
    for i, f in enumerate(plan.functions):
        name = json.dumps(f.name, ensure_ascii=False)
        args = f"%json {json.dumps(args_schema(f, reach))}"
        if bare:  # the arguments' rule, shared by the block's call and the bare one
            lines.append(f"args_{i}: {args}")
            args = f"args_{i}"
            lines.append(f"bare_{i}: {json.dumps(BARE + name + ', ')} bare_key {args}")
        lines.append(f"fn_{i}: {json.dumps(BARE + name + ARGS_AT)} {args}")
    return "\n".join(lines) + "\n"


def _either(text: str, tag: str, token: int | None) -> str:
    """`text`, markup that holds `tag`, as a grammar piece: where the tag is an added token (`token`),
    the text or the same markup with that token in the tag's place."""
    if token is None:
        return json.dumps(text)
    before, after = text.split(tag)
    parts = [
        *([json.dumps(before)] if before else []),
        f"<[{token}]>",
        *([json.dumps(after)] if after else []),
    ]
    return f"({json.dumps(text)} | {' '.join(parts)})"


_BARE_RE = re.escape(BARE).replace("\\ ", " ")  # llguidance's regex takes a space as it is
