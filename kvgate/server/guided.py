"""Structured output asked the way vLLM's and llama.cpp's clients ask: one constraint, one grammar.

Beside OpenAI's `response_format`, chat and completions take:
- vLLM's `structured_outputs` object: `json` (a schema, or its JSON text), `regex`, `choice` (the
  output is one of these strings), `grammar` (Lark or GBNF), `json_object: true`; exactly one of them;
- vLLM's older spellings of the same, `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`
  (`guided_decoding_backend` is accepted and ignored: kvgate has one grammar engine, llguidance);
- llama.cpp's server fields `json_schema` (an object; SGLang sends its text) and `grammar` (GBNF).

Each becomes a Lark grammar for the same compiler as `response_format` (`kvgate.server.features`): the
same grammar slots, the same memory plan, the same 400 naming what the engine cannot do. A JSON schema
is generated compact, as `response_format`'s (`disable_any_whitespace` is accepted either way: compact
JSON is valid with or without it), and so is `disable_additional_properties` (objects that name their
properties take no others unless the schema says so, as under vLLM's default backend:
`schema_prep.closed_objects`). What would change the output and is not done is refused by name:
`whitespace_pattern`, `structural_tag`. Asking for two
constraints (two of these, or one with a non-text `response_format` or with `tools`) is a 400, as vLLM's
"only one kind of structured outputs constraint".
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import llguidance
from llguidance.gbnf_to_lark import any_to_lark
from pydantic import BaseModel, ConfigDict, Field

from kvgate.server.errors import APIError, invalid, unsupported
from kvgate.structured.compiler import (
    LEXER_STATES,
    MAX_GRAMMAR_CHARS,
    OTHER_STATES,
    STATES_PER_CHAR,
    GrammarError,
)
from kvgate.structured.schema_prep import COUNTS, grammar_schema


class StructuredOutputs(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None  # compact JSON either way
    disable_fallback: bool | None = None  # there is one backend: nothing to fall back from
    disable_additional_properties: bool | None = None  # closed by default either way (closed_objects)
    whitespace_pattern: str | None = None
    structural_tag: str | None = None


class GuidedFields(BaseModel):
    """The request fields, for chat and completions (`kvgate.server.protocol._Common`)."""

    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # accepted and ignored (one engine)
    guided_whitespace_pattern: str | None = None
    json_schema: dict[str, Any] | str | None = None  # llama.cpp's (SGLang's is the text)
    grammar: str | None = None  # llama.cpp's GBNF


@dataclass(frozen=True)
class Constraint:
    param: str  # the field as sent, for a 400
    kind: str  # json | regex | choice | grammar
    value: Any


def constraint_of(req) -> Constraint | None:
    """The one constraint these fields ask for, or None; a 400 for two, or for what is not done."""
    so = req.structured_outputs
    asked: list[Constraint] = []
    if so is not None:
        for name, flag, hint in (
            ("whitespace_pattern", so.whitespace_pattern, "kvgate writes compact JSON"),
            ("structural_tag", so.structural_tag, "send a grammar or a JSON schema"),
        ):
            if flag is not None:
                raise unsupported(f"structured_outputs.{name}", f"not implemented ({hint}); leave it out")
        names = [f"structured_outputs.{n}" for n in ("json", "regex", "choice", "grammar")]
        asked += _kinds(names, so.json_, so.regex, so.choice, so.grammar)
        if so.json_object:
            asked.append(Constraint("structured_outputs.json_object", "json", {"type": "object"}))
    if req.guided_whitespace_pattern is not None:
        raise unsupported(
            "guided_whitespace_pattern", "not implemented (kvgate writes compact JSON); leave it out"
        )
    names = ["guided_json", "guided_regex", "guided_choice", "guided_grammar"]
    asked += _kinds(names, req.guided_json, req.guided_regex, req.guided_choice, req.guided_grammar)
    if req.json_schema is not None:
        asked.append(Constraint("json_schema", "json", _schema("json_schema", req.json_schema)))
    if req.grammar is not None:
        asked.append(Constraint("grammar", "grammar", req.grammar))
    if len(asked) > 1:
        raise invalid(
            f"{asked[0].param} and {asked[1].param} each constrain the output: send only one kind of "
            "structured output constraint",
            param=asked[1].param,
        )
    return asked[0] if asked else None


def _kinds(names: list[str], js, regex, choice, grammar) -> list[Constraint]:
    """The constraints given under `names` (the json, regex, choice and grammar fields as sent)."""
    out = []
    if js is not None:
        out.append(Constraint(names[0], "json", _schema(names[0], js)))
    for param, kind, value in zip(names[1:], ("regex", "choice", "grammar"), (regex, choice, grammar)):
        if value is not None:
            out.append(Constraint(param, kind, value))
    return out


def _schema(param: str, value) -> dict:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise invalid(
                f"{param} is a string that is not JSON ({exc}); send the schema itself", param
            ) from None
    if not isinstance(value, dict):
        raise invalid(f"{param} must be a JSON schema (an object)", param=param)
    return value


def lark_of(c: Constraint, json_style: dict, reach: int | None = None) -> str:
    """The grammar text for the compiler (a 400 naming the field where it cannot be made)."""
    if c.kind == "json":
        schema = grammar_schema(c.value, json_style, reach)
        return "start: %json " + json.dumps(schema, ensure_ascii=False) + "\n"
    size = len(c.value) if isinstance(c.value, str) else sum(len(x) for x in c.value or [])
    if size > MAX_GRAMMAR_CHARS:  # before any parsing: the compiler's bound
        raise invalid(
            f"{c.param} is {size:,} characters; kvgate compiles at most {MAX_GRAMMAR_CHARS:,} (its planned "
            "memory per grammar)",
            c.param,
        )
    if c.kind == "regex":
        spec = json.loads(llguidance.LLMatcher.grammar_from_regex(c.value))
        return spec["grammars"][0]["lark_grammar"] + "\n"
    if c.kind == "choice":
        if not c.value or not all(c.value):
            raise invalid(
                f"{c.param} must be a list of non-empty strings, one of which is the output", c.param
            )
        return "start: " + " | ".join(json.dumps(s, ensure_ascii=False) for s in c.value) + "\n"
    try:
        return any_to_lark(c.value)
    except Exception as exc:  # GbnfToLarkError, and bare Exceptions ("Rule 'x' not found")
        raise invalid(
            f"{c.param} is neither a Lark nor a GBNF grammar kvgate can read: {exc}", c.param
        ) from None


def check_counts(c: Constraint) -> None:
    """A regex's or grammar's counted repeats (`{n}`, `{n,m}`) within the lexer states a grammar has, as
    a schema's string bounds are (`compiler.check_lengths`, which `features_of` runs on a json one):
    never found short mid-answer."""
    n = sum(int(b or a) for a, b in COUNTS.findall(c.value)) if c.kind in ("regex", "grammar") else 0
    need = STATES_PER_CHAR * n + OTHER_STATES
    if need > LEXER_STATES:
        raise GrammarError(
            f"its counted repeats ({{n}} and {{n,m}}) add up to {n:,} characters, which would need about "
            f"{need:,} lexer states while generating, and a grammar has {LEXER_STATES:,} (its planned "
            f"memory). Keep them under {(LEXER_STATES - OTHER_STATES) // STATES_PER_CHAR:,} characters in all "
            "(an unbounded repeat with max_tokens bounds the output too)"
        )


def guided_error(c: Constraint, why: str) -> APIError:
    """The 400 for a constraint the grammar engine refused, naming the field as sent."""
    what = "this JSON schema" if c.kind == "json" else f"this {c.kind}"
    code = "unsupported_schema" if c.kind == "json" else "invalid_grammar"
    return APIError(400, f"{c.param}: {what} cannot be enforced: {why}", code, param=c.param)
