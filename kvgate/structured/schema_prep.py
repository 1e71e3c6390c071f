"""A request's JSON schema made ready for the grammar engine, and its refusals made to point somewhere.

- `engine_schema`: a `format` the engine does not know is dropped, and the value stays a plain
  string. In JSON Schema (2020-12) `format` is an annotation unless a validator opts into asserting
  it, so this is what the schema means; pydantic writes `binary` for `bytes` and `password` for
  `SecretStr`, and those requests were 400s. The formats the engine knows (`date-time`, `email`,
  `uuid`, ...) stay enforced, and a `pattern` beside one that the engine cannot take (zod 4 writes
  look-aheads for `z.iso.duration()`) is dropped: the format holds. Which it knows is asked of the
  engine, once per distinct value. `date`
  and `date-time` become patterns of real calendar days (the engine's allow February 29 every year),
  held beside a schema's own `pattern` through `allOf`.
- zod 4's record forms, which the engine does not take as written: `propertyNames: {"type":
  "string"}` (always true: JSON keys are strings) is dropped; `propertyNames` with an `enum` or
  `const` (`z.record(z.enum(...))`) becomes those keys as `properties` of the values' schema; with a
  `pattern`, `patternProperties`; and a property whose schema is `{"not": {}}` or `false` (`z.never()`:
  it may never appear) is left out of `properties` (QA pass 9: every AI SDK or LangChain.js schema
  with a record field, and every request offering a tool with one, was a 400).
- The annotations that never change what is generated (`description`, `title`, `examples`, ...) are
  left out of the grammar's copy: they counted against its 32 KiB bound.
- `keyword_paths`: where refused keywords sit (`properties.tags.uniqueItems`), for the 400.

Both walk only the places that hold schemas: the names under `properties` or `$defs` are a schema's
own names (a property may be called "format"), never keywords.
"""

from __future__ import annotations

import copy
import functools
import json
import re

import llguidance

# keywords whose value maps names to schemas, and those whose value is a schema or a list of them
NAMED_SCHEMAS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
SUBSCHEMAS = (
    "items",
    "prefixItems",
    "additionalItems",
    "additionalProperties",
    "anyOf",
    "oneOf",
    "allOf",
    "not",
    "if",
    "then",
    "else",
    "contains",
    "propertyNames",
    "unevaluatedItems",
    "unevaluatedProperties",
)


ANNOTATIONS = ("description", "title", "examples", "$comment", "deprecated", "readOnly", "writeOnly")

# `date` and `date-time` as calendar dates: the engine's own regexes allow February 29 in every year (QA
# pass 8 saw 2015-02-29 under strict json_schema, which jsonschema's format checker and pydantic refuse).
# Years 0001-9999 (RFC 3339 allows 0000, which Python's date and pydantic refuse) and seconds 00-59
# (RFC 3339's leap second 60 is refused by Python's datetime): what every client can parse. Fractional
# seconds to nanoseconds (Go's and Java's most; QA pass 16 saw a weak model write 50 digits to max_tokens).
_YEAR = "(?:[1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])"
_LEAP = "(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
_DAY = "(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)|02-(?:0[1-9]|1[0-9]|2[0-8]))"
DATE = f"(?:{_YEAR}-{_DAY}|{_LEAP}-02-29)"
TIME = (
    "(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\\.[0-9]{1,9})?(?:[zZ]|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
)
FORMAT_PATTERNS = {"date": f"^{DATE}$", "date-time": f"^{DATE}[tT]{TIME}$"}


# JSON Schema 2020-12's formats: the engine is asked once which of these it enforces; any other value
# (a client's own, sent once per request) is never compiled nor remembered (a cache keyed on what
# clients send would grow for the life of the process: review of session 33)
STANDARD_FORMATS = (
    "date-time date time duration email idn-email hostname idn-hostname ipv4 ipv6 uri uri-reference "
    "iri iri-reference uuid uri-template json-pointer relative-json-pointer regex"
).split()


@functools.cache
def enforced_formats() -> frozenset[str]:
    """The standard formats the grammar engine enforces (asked of it once)."""
    return frozenset(f for f in STANDARD_FORMATS if compiles({"type": "string", "format": f}))


def known_format(name: str) -> bool:
    """Whether the grammar engine enforces strings of this `format`."""
    return name in enforced_formats()


def _children(schema: dict, path: str):
    """(sub-schema, its path) for every schema directly inside `schema`."""
    for key in NAMED_SCHEMAS:
        named = schema.get(key)
        if isinstance(named, dict):
            for name, sub in named.items():
                yield sub, f"{path}{key}.{name}."
    for key in SUBSCHEMAS:
        sub = schema.get(key)
        if isinstance(sub, list):
            for i, s in enumerate(sub):
                yield s, f"{path}{key}.{i}."
        elif sub is not None:
            yield sub, f"{path}{key}."


OPEN_KEYS = {"additionalProperties", "patternProperties", "unevaluatedProperties"}  # the schema decides


def closed_objects(schema):
    """A copy of `schema` in which an object schema that names its `properties` and says nothing of
    others takes no others (`additionalProperties: false`), as vLLM's default grammar backend (xgrammar's
    strict mode) and OpenAI's strict schemas do. JSON Schema allows the others, so a small model filled
    tool arguments with keys the function does not take, and pydantic's schemas (which never say it) with
    keys until max_tokens (QA pass 16). Kept open: objects that name no properties (`{"type": "object"}`
    is any object), ones that say `additionalProperties`, `patternProperties` or
    `unevaluatedProperties`, and the members of an `allOf` (each holds only part of the properties)."""
    out = copy.deepcopy(schema)

    def walk(node, closable: bool) -> None:
        if not isinstance(node, dict):
            return
        if closable and isinstance(node.get("properties"), dict) and not OPEN_KEYS & node.keys():
            node["additionalProperties"] = False
        for sub, path in _children(node, ""):
            key = path.split(".", 1)[0]
            walk(sub, closable if key in ("anyOf", "oneOf") else key != "allOf")

    walk(out, True)
    return out


INTEGER_BOUNDS = {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "enum", "const"}
MAX_INTEGER = 10**16 - 1


def grammar_schema(schema: dict, style: dict, reach: int | None = None) -> dict:
    """A client's JSON schema as the grammar takes it: its open objects closed (`closed_objects`), the
    engine's copy (`engine_schema`), and the generated JSON's `style` (llguidance's `x-guidance`). One
    place for tools' parameters, `response_format` and vLLM's / llama.cpp's schema fields. `reach`: the
    most characters any output here can have; a `maxLength` at or past it can never bind, and goes."""
    out = engine_schema(closed_objects(schema), reach)
    out["x-guidance"] = style
    return out


def engine_schema(schema, reach: int | None = None):
    """A copy of `schema` for the engine: without the `format`s it does not know, nor the annotations
    that never change what is generated (`ANNOTATIONS`: a grammar's text holds its schema, and the
    32 KiB bound on it counted descriptions, so verbose simple schemas were refused)."""
    if not isinstance(schema, dict):
        return schema
    out = {k: v for k, v in schema.items() if k not in ANNOTATIONS}
    if unreachable(out.get("maxLength"), reach):  # Claude Code's 524,288 on a 8k-token model
        del out["maxLength"]
    fmt = out.get("format")
    if isinstance(fmt, str) and not known_format(fmt):
        del out["format"]
    elif isinstance(fmt, str):
        if isinstance(out.get("pattern"), str) and not _pattern_compiles(out["pattern"]):
            del out["pattern"]  # the format says it (zod writes both: its duration pattern has look-aheads)
        if fmt in FORMAT_PATTERNS:  # the calendar's own days (FORMAT_PATTERNS), and the schema's pattern
            del out["format"]
            if "pattern" in out:
                out["allOf"] = [*out.get("allOf", []), {"pattern": FORMAT_PATTERNS[fmt]}]
            else:
                out["pattern"] = FORMAT_PATTERNS[fmt]
    if out.get("type") == "integer" and not INTEGER_BOUNDS & out.keys():  # at most 16 digits, as llama.cpp's
        out["minimum"], out["maximum"] = -MAX_INTEGER, MAX_INTEGER  # grammar: a weak model wrote 1111... to
        # max_tokens (QA pass 16), and 16 digits already pass JSON's safe integers (2^53, 9.0e15)
    _record_keys(out)
    for key in NAMED_SCHEMAS:
        if isinstance(out.get(key), dict):
            out[key] = {name: engine_schema(sub, reach) for name, sub in out[key].items()}
    for key in SUBSCHEMAS:
        sub = out.get(key)
        if isinstance(sub, list):
            out[key] = [engine_schema(s, reach) for s in sub]
        elif isinstance(sub, dict):
            out[key] = engine_schema(sub, reach)
    return out


def _record_keys(out: dict) -> None:
    """`propertyNames` in forms the engine takes, and never-present properties left out (the module's
    doc); any other `propertyNames` stays, for the engine's refusal to name."""
    if isinstance(out.get("propertyNames"), dict):
        _property_names(out, {k: v for k, v in out["propertyNames"].items() if k not in ANNOTATIONS})
    props = out.get("properties")
    if isinstance(props, dict) and any(v is False or v == {"not": {}} for v in props.values()):
        out["properties"] = {k: v for k, v in props.items() if not (v is False or v == {"not": {}})}


def _property_names(out: dict, rule: dict) -> None:
    """`out`'s `propertyNames` (`rule`, less its annotations) as the keys it allows, where it is a string
    rule of no kind, of an `enum` / `const` of keys, or of a `pattern`."""
    if rule.get("type", "string") != "string" or not set(rule) <= {"type", "enum", "const", "pattern"}:
        return
    keys = rule["enum"] if "enum" in rule else [rule["const"]] if "const" in rule else None
    pattern = rule.get("pattern")
    value = out.get("additionalProperties", True)
    props = out.get("properties") if isinstance(out.get("properties"), dict) else {}
    if keys is None and pattern is None:  # any string: always true
        del out["propertyNames"]
        return
    if pattern is None and isinstance(keys, list) and all(isinstance(k, str) for k in keys):
        allowed = props if value is False else {k: props.get(k, value) for k in keys}
        out["properties"] = {k: v for k, v in allowed.items() if k in keys}
    elif keys is None and not props and "patternProperties" not in out and value is not False:
        out["patternProperties"] = {pattern: value}
    else:
        return
    out["additionalProperties"] = False
    del out["propertyNames"]


COUNTS = re.compile(r"(?<!\\)\{(\d+)(?:,(\d+))?\}")  # a regex's {n} and {n,m} (not {n,}: no count)


def unreachable(max_length, reach: int | None) -> bool:
    """Whether a `maxLength` is one no output can reach (`reach`: its most characters), so no bound."""
    return reach is not None and isinstance(max_length, int) and max_length >= reach


def length_bounds(schema, reach: int | None = None) -> list[tuple[str, int]]:
    """(path, characters) for each distinct string lexeme that counts characters in `schema`: its
    `minLength` / `maxLength` (the larger) plus its `pattern`'s counted repeats, the first path it is
    found at (`compiler.check_lengths`). Strings of one lexeme share its states (measured: ten fields of
    maxLength 100 cost one's; ten of 100..109 cost ten's; the review of session 36: minLength 280..291
    under one maxLength 300 are twelve lexemes, not one)."""
    found: dict[tuple, tuple[str, int]] = {}

    def walk(node, path: str) -> None:
        if not isinstance(node, dict):
            return
        lo, hi, pattern = node.get("minLength"), node.get("maxLength"), node.get("pattern")
        hi = None if unreachable(hi, reach) else hi
        bound = max((b for b in (lo, hi) if isinstance(b, int)), default=0)
        if isinstance(pattern, str):  # a pattern's counted repeats are counted the same way
            bound += sum(int(b or a) for a, b in COUNTS.findall(pattern))
        if bound > 0:
            key = (lo, hi, pattern if isinstance(pattern, str) else None, node.get("format"))
            found.setdefault(key, (path.rstrip(".") or "the root", bound))
        for sub, where in _children(node, path):
            walk(sub, where)

    walk(schema, "")
    return list(found.values())


def keyword_paths(schema, keywords: set[str], path: str = "") -> list[str]:
    """Dotted paths of the `keywords` used as keywords anywhere in `schema`."""
    if not isinstance(schema, dict):
        return []
    found = [path + k for k in schema if k in keywords]
    for sub, where in _children(schema, path):
        found += keyword_paths(sub, keywords, where)
    return found


def unimplemented(message: str) -> set[str]:
    """The keywords an engine message names as `Unimplemented keys: ["a", "b"]`, if any."""
    marker = "Unimplemented keys:"
    if marker not in message:
        return set()
    tail = message.split(marker, 1)[1].strip()
    try:
        keys, _ = json.JSONDecoder().raw_decode(tail)
    except json.JSONDecodeError:
        return set()
    return {k for k in keys if isinstance(k, str)} if isinstance(keys, list) else set()


@functools.lru_cache(maxsize=256)  # bounded: patterns are what clients send
def _pattern_compiles(pattern: str) -> bool:
    return compiles({"type": "string", "pattern": pattern})


def compiles(schema: dict) -> bool:
    """Whether the engine takes `schema` alone (which of several tools a refusal is about)."""
    return not llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_json_schema(schema))
