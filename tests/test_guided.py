"""Structured output the way vLLM's and llama.cpp's clients ask for it (`kvgate.server.guided`):
`structured_outputs`, `guided_*`, llama.cpp's `json_schema` and `grammar`, on chat and completions.

The tiny model's random weights wander: only the grammar keeps its output inside the constraint, so
each test below fails when the field is dropped (seen red with `constraint_of` returning None: the
choices came back as random text, the regex and JSON did not match, and the 400s were 200s).
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

from tests.test_structured import CHAT, MSG, PERSON, tiny_base, tiny_engine  # noqa: F401 (fixtures)

SCHEMA = PERSON  # a closed object of a bounded string and a bounded integer
CHOICES = ["positive", "negative", "neutral"]
REGEX = r"[a-f]{2,4}-[0-9]{3}"
GBNF = 'root ::= "yes" | "no" | "maybe " digit\ndigit ::= [0-9]'
LARK = 'start: "yes" | "no" | "maybe " DIGIT\nDIGIT: /[0-9]/'


def _text(base: str, path: str, body: dict) -> tuple[str, str]:
    extra = {"messages": MSG} if path == CHAT else {"prompt": "Answer:"}
    r = httpx.post(base + path, json={**extra, "max_tokens": 120, "temperature": 1.0, **body}, timeout=60)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    return (c["message"]["content"] if path == CHAT else c["text"]), c["finish_reason"]


@pytest.mark.parametrize("path", [CHAT, "/v1/completions"])
@pytest.mark.parametrize(
    "body, check",
    [
        ({"structured_outputs": {"choice": CHOICES}}, lambda t: t in CHOICES),
        ({"guided_choice": CHOICES}, lambda t: t in CHOICES),
        ({"structured_outputs": {"regex": REGEX}}, lambda t: re.fullmatch(REGEX, t)),
        ({"guided_regex": REGEX}, lambda t: re.fullmatch(REGEX, t)),
        (
            {"structured_outputs": {"json": SCHEMA}},
            lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None,
        ),
        ({"guided_json": json.dumps(SCHEMA)}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
        ({"json_schema": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
        ({"structured_outputs": {"json_object": True}}, None),  # any object: the random model may not end it
        ({"grammar": GBNF}, lambda t: re.fullmatch(r"yes|no|maybe \d", t)),
        ({"structured_outputs": {"grammar": LARK}}, lambda t: re.fullmatch(r"yes|no|maybe \d", t)),
        (
            {"guided_grammar": GBNF, "guided_decoding_backend": "xgrammar"},
            lambda t: re.fullmatch(r"yes|no|maybe \d", t),
        ),
    ],
)
def test_every_spelling_constrains_the_output(tiny_base, path, body, check):  # noqa: F811
    for seed in (1, 2, 3):
        text, reason = _text(tiny_base, path, {**body, "seed": seed})
        if check is None:  # json_object: an object, whole when it stopped
            assert text.startswith("{") and (reason == "length" or isinstance(json.loads(text), dict))
        else:
            assert reason == "stop" and check(text), (text, reason)


def test_a_streamed_constrained_answer_equals_the_whole_one(tiny_base):  # noqa: F811
    body = {"messages": MSG, "max_tokens": 60, "seed": 5, "temperature": 1.0, "guided_regex": REGEX}
    whole = httpx.post(tiny_base + CHAT, json=body, timeout=60).json()["choices"][0]["message"]["content"]
    parts = []
    with httpx.stream("POST", tiny_base + CHAT, json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                parts += [c["delta"].get("content") or "" for c in json.loads(line[6:])["choices"]]
    assert "".join(parts) == whole and re.fullmatch(REGEX, whole)


@pytest.mark.parametrize(
    "body, status, code, param",
    [
        ({"guided_choice": ["a"], "guided_regex": "b"}, 400, "invalid_value", "guided_choice"),
        (
            {"structured_outputs": {"regex": "a", "choice": ["b"]}},
            400,
            "invalid_value",
            "structured_outputs.choice",
        ),
        ({"grammar": GBNF, "response_format": {"type": "json_object"}}, 400, "invalid_value", "grammar"),
        (
            {
                "guided_choice": ["a"],
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
            },
            400,
            "invalid_value",
            "guided_choice",
        ),
        ({"structured_outputs": {"whitespace_pattern": " "}}, 400, "unsupported_parameter", None),
        ({"guided_whitespace_pattern": r"\s*", "guided_json": SCHEMA}, 400, "unsupported_parameter", None),
        ({"guided_regex": "(?=a)b"}, 400, "invalid_grammar", "guided_regex"),
        (
            {"grammar": "root ::= foo"},
            400,
            "invalid_value",
            "grammar",
        ),  # a 500 before: the converter's bare Exception
        (
            {"guided_regex": "a{5000}"},
            400,
            "invalid_grammar",
            "guided_regex",
        ),  # past the lexer's planned states
        ({"json_schema": "{not json"}, 400, "invalid_value", "json_schema"),
        ({"guided_choice": []}, 400, "invalid_value", "guided_choice"),
        (
            {"grammar": "root ::= " + " | ".join(['"x"'] * 9000)},
            400,
            "invalid_value",
            "grammar",
        ),  # over 32 KiB
        (
            {"structured_outputs": {"json": {"type": "object", "not": {}}}},
            400,
            "unsupported_schema",
            "structured_outputs.json",
        ),
        (
            {"structured_outputs": {"regexp": "a"}},
            400,
            None,
            None,
        ),  # a misspelled key is refused, not ignored
    ],
)
def test_what_cannot_be_honoured_is_a_400_naming_the_field(tiny_base, body, status, code, param):  # noqa: F811
    r = httpx.post(tiny_base + CHAT, json={"messages": MSG, "max_tokens": 8, **body}, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    if code is not None:
        assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err
    if "a{5000}" in json.dumps(body):
        assert "5,000 characters" in err["message"] and "counted repeats" in err["message"]


def test_the_openai_sdk_sends_them_through_extra_body(tiny_base):  # noqa: F811
    """What vLLM's docs tell openai-SDK users to write."""
    from openai import OpenAI

    client = OpenAI(base_url=tiny_base + "/v1", api_key="x")
    for extra in ({"structured_outputs": {"choice": CHOICES}}, {"guided_choice": CHOICES}):
        out = client.chat.completions.create(
            model="tiny", messages=MSG, max_tokens=20, temperature=1.0, seed=9, extra_body=extra
        )
        assert out.choices[0].message.content in CHOICES


def test_objects_that_name_their_properties_take_no_others(tiny_base):  # noqa: F811
    """An open schema (pydantic writes no additionalProperties) is generated as if its objects said
    false, as under vLLM's default backend; `disable_additional_properties` asks the same. Red with
    `closed_objects` returning its input: the random model adds keys (and runs to max_tokens)."""
    open_schema = {k: v for k, v in SCHEMA.items() if k != "additionalProperties"}
    closed = {**open_schema, "additionalProperties": False}
    for so in ({"json": open_schema}, {"json": open_schema, "disable_additional_properties": True}):
        for seed in (1, 2, 3):
            text, reason = _text(tiny_base, CHAT, {"structured_outputs": so, "seed": seed})
            assert reason == "stop", (text, reason)
            jsonschema.validate(json.loads(text), closed)


def test_an_unbounded_integer_ends_within_16_digits(tiny_base):  # noqa: F811
    """QA pass 16: a weak model wrote 1111... into an integer until max_tokens. An integer without bounds
    is held to 16 digits, as llama.cpp's grammar holds it. Here "1" is pushed by logit_bias, so only the
    grammar can end the number. Red without the bounds in `engine_schema`: the row ran to max_tokens."""
    one = httpx.post(tiny_base + "/v1/tokenize", json={"prompt": "1", "add_special_tokens": False}).json()
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    body = {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}}
    body["logit_bias"] = {str(one["tokens"][0]): 100}
    text, reason = _text(tiny_base, CHAT, {**body, "seed": 1})
    assert reason == "stop" and json.loads(text) == {"n": 10**16 // 9}, (text, reason)


def test_fractional_seconds_end_at_nanoseconds(tiny_base):  # noqa: F811
    """QA pass 16: zod's `z.string().datetime()` answers ran their fraction of a second to max_tokens
    (`47.6115483085761662...`). `date-time` takes at most 9 fractional digits. "1" (and the "." that
    starts the fraction) is pushed by logit_bias, so only the grammar ends the fraction. Red with `[0-9]+` back in TIME."""
    ids = httpx.post(tiny_base + "/v1/tokenize", json={"prompt": "1.", "add_special_tokens": False}).json()
    schema = {
        "type": "object",
        "properties": {"t": {"type": "string", "format": "date-time"}},
        "required": ["t"],
    }
    body = {"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}}
    body["logit_bias"] = {str(t): 100 for t in ids["tokens"]}  # "1", and the "." that starts the fraction
    text, reason = _text(tiny_base, CHAT, {**body, "seed": 1})
    assert reason == "stop" and re.search(r"\.1{9}[zZ+-]", json.loads(text)["t"]), (text, reason)
