"""Structured output (issue 13): JSON schemas and json_object enforced by a token mask in the sampler.

Most tests run the tiny byte-level model (its random weights wander: only the grammar keeps the output
valid); the `slow` ones use SmolLM2 through the official openai client and measure memory.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import httpx
import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from kvgate.request import GenerationRequest
from kvgate.sampling import Sampler, SamplingParams, sample_batch
from kvgate.server.tools import JSON_STYLE
from kvgate.structured import masks
from kvgate.structured.compiler import compiler_for
from tests.server_util import running_server

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "Give me JSON."}]


def grammar_of(engine, schema: dict):
    comp = compiler_for(engine.tokenizer, engine.spec.vocab_size, engine.plan.limits.grammars)
    return comp.check("start: %json " + json.dumps({**schema, "x-guidance": JSON_STYLE}))


@pytest.fixture(scope="module")
def tiny_engine(tiny_dir):
    from kvgate.config import EngineConfig
    from kvgate.core.engine import Engine

    cfg = EngineConfig(kv_cache_bytes=32 << 20, memory_limit="2GiB", dtype="float32", device="cpu")
    e = Engine.from_model(str(tiny_dir), cfg, overhead_bytes=0).start()
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def tiny_base(tiny_engine):
    with running_server(tiny_engine) as (base, _app):
        yield base


# ---- the sampler ---------------------------------------------------------------------------------
def test_a_grammar_row_draws_only_what_its_mask_allows_and_ends_when_the_grammar_does(tiny_engine):
    """Random logits, 40 draws per seed: every token is accepted by the grammar and the text is one
    of its words. Sabotage seen red: `apply_bitmask` made a no-op -> ValueError "the grammar allows no
    token here" (the sampler's own check), and with that check removed too -> the text is not a word."""
    tok = tiny_engine.tokenizer
    comp = compiler_for(tok, tiny_engine.spec.vocab_size, 4)
    g = comp.check('start: "yes" | "no" | "maybe"\n')
    for seed in range(10):
        s = Sampler(SamplingParams(temperature=1.0, seed=seed, grammar=g), [], tok.vocab_size)
        gen = torch.Generator().manual_seed(seed)
        out = []
        while not s.grammar_done and len(out) < 40:
            logits = torch.randn(1, tiny_engine.spec.vocab_size, generator=gen) * 3
            out += sample_batch([s], logits)
        text = tok.decode([t for t in out if t not in tok.eog_ids])
        assert text in ("yes", "no", "maybe") and s.grammar_done, (seed, text)


def test_rows_without_a_grammar_pay_nothing(monkeypatch):
    """No mask is computed or applied when no row of the batch has a grammar.
    Sabotage seen red: computing masks for every row (the fill is called and raises here)."""

    def boom(*a, **k):
        raise AssertionError("a mask was computed for a row without a grammar")

    monkeypatch.setattr(masks, "fill_bitmasks", boom)
    monkeypatch.setattr(masks, "apply_bitmask", boom)
    samplers = [Sampler(SamplingParams(temperature=t, seed=1), [], 50) for t in (0.0, 0.7, 1.0)]
    assert len(sample_batch(samplers, torch.randn(3, 50))) == 3


# ---- 200 random schemas --------------------------------------------------------------------------
def _leaf():
    word = st.text("abcxyz", min_size=1, max_size=4)
    return st.one_of(
        st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(1, 6)),
        st.builds(
            lambda a, n: {"type": "string", "minLength": a, "maxLength": a + n},
            st.integers(1, 3),
            st.integers(0, 3),
        ),
        st.builds(
            lambda a, n: {"type": "integer", "minimum": a, "maximum": a + n},
            st.integers(-50, 50),
            st.integers(0, 500),
        ),
        st.just({"type": "boolean"}),
        st.just({"type": "null"}),
        st.builds(lambda xs: {"enum": sorted(set(xs))}, st.lists(word, min_size=1, max_size=4)),
        st.builds(lambda x: {"const": x}, st.one_of(word, st.integers(0, 9), st.booleans())),
        st.just({"type": "string", "pattern": "^[a-c]{1,3}$"}),
    )


def _extend(children):
    names = st.text("abcdefgh", min_size=1, max_size=5)

    def obj(props, req_mask):
        keys = list(props)
        return {
            "type": "object",
            "properties": props,
            "required": [k for k, r in zip(keys, req_mask) if r],
            "additionalProperties": False,
        }

    return st.one_of(
        st.builds(
            obj,
            st.dictionaries(names, children, min_size=1, max_size=4),
            st.lists(st.booleans(), min_size=4, max_size=4),
        ),
        st.builds(
            lambda it, a, n: {"type": "array", "items": it, "minItems": a, "maxItems": a + n},
            children,
            st.integers(0, 1),
            st.integers(0, 2),
        ),
        st.builds(lambda x, y: {"anyOf": [x, y]}, children, children),
    )


NODES = st.recursive(_leaf(), _extend, max_leaves=6)
# The documents: an object with 2-5 properties, each present (so no output is trivially short)
SCHEMAS = st.builds(
    lambda props: {
        "type": "object",
        "properties": props,
        "required": sorted(props),
        "additionalProperties": False,
    },
    st.dictionaries(st.text("abcdefgh", min_size=1, max_size=6), NODES, min_size=2, max_size=5),
)


def generate_all(engine, schemas: list[dict], max_tokens: int = 400) -> list[tuple[dict, str, str]]:
    prompt = engine.tokenizer.encode("JSON:")
    handles = []
    for i, schema in enumerate(schemas):
        sp = SamplingParams(temperature=1.0, seed=i, grammar=grammar_of(engine, schema))
        handles.append(engine.submit(GenerationRequest(prompt, sp, max_tokens)))
    return [(s, (r := h.result(timeout=600)).text, r.finish_reason) for s, h in zip(schemas, handles)]


def invalid_outputs(results) -> list:
    bad = []
    for schema, text, reason in results:
        try:
            jsonschema.validate(json.loads(text), schema)
            if reason != "stop":
                bad.append((schema, text, reason))
        except (ValueError, jsonschema.ValidationError) as exc:
            bad.append((schema, text, f"{reason}: {exc}"[:200]))
    return bad


def random_schemas(n: int) -> list[dict]:
    """`n` schemas drawn by hypothesis's generator (no shrinking, fixed seed: the same every run)."""
    out: list[dict] = []

    @settings(
        max_examples=n,
        phases=[Phase.generate],
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(SCHEMAS)
    def collect(schema):
        out.append(schema)

    collect()
    return out


def test_200_random_schemas_all_give_output_that_validates(tiny_engine):
    """200 hypothesis-generated schemas (objects, arrays, anyOf, enums, consts, bounded strings and
    integers, patterns), one request each at temperature 1 on the random tiny model, all at once:
    every output parses and validates, and every one ended because its grammar did.
    A broken mask is seen to fail it: test_a_broken_mask_is_caught_by_the_schema_check (and, by hand,
    `apply_bitmask` made a no-op with `allows` disarmed: 200 of 200 invalid)."""
    schemas = random_schemas(200)
    assert len(schemas) == 200 and len({json.dumps(s, sort_keys=True) for s in schemas}) > 150
    results = generate_all(tiny_engine, schemas)
    assert sum(len(text) for _, text, _ in results) > 200 * 8  # real documents, not 200 empty strings
    bad = invalid_outputs(results)
    assert not bad, f"{len(bad)} of 200 invalid, e.g. {bad[:3]}"


def test_a_broken_mask_is_caught_by_the_schema_check(tiny_engine, monkeypatch):
    """The same check as above with the mask switched off (and the sampler's own allowed-token check
    disarmed): most outputs are invalid, so the 200-schema test can fail."""
    monkeypatch.setattr(masks, "apply_bitmask", lambda logits, bitmask: None)
    monkeypatch.setattr(masks, "allows", lambda row, token: True)
    rnd = random.Random(3)
    schemas = [
        {"type": "object", "properties": {"a": {"type": "integer", "maximum": rnd.randint(1, 9)}}}
        for _ in range(10)
    ]
    bad = invalid_outputs(generate_all(tiny_engine, schemas, max_tokens=30))
    assert len(bad) >= 8


# ---- over HTTP -----------------------------------------------------------------------------------
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def fmt(schema=PERSON):
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


def test_json_schema_chat_stream_equals_whole_and_validates(tiny_base):
    """Seen red with the grammar dropped in prepare (features_of returning no grammar): the random
    model's text does not parse."""
    body = {"messages": MSG, "max_tokens": 200, "seed": 7, "temperature": 1.0, "response_format": fmt()}
    whole = httpx.post(tiny_base + CHAT, json=body, timeout=60).json()
    text = whole["choices"][0]["message"]["content"]
    jsonschema.validate(json.loads(text), PERSON)
    assert whole["choices"][0]["finish_reason"] == "stop"
    parts = []
    with httpx.stream("POST", tiny_base + CHAT, json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    parts.append(c["delta"].get("content") or "")
    assert "".join(parts) == text


def test_json_object_and_completions_endpoint(tiny_base):
    for path, extra in ((CHAT, {"messages": MSG}), ("/v1/completions", {"prompt": "JSON:"})):
        body = {**extra, "max_tokens": 300, "seed": 3, "response_format": {"type": "json_object"}}
        for schema in ({"type": "object"},):
            r = httpx.post(tiny_base + path, json=body, timeout=60).json()
            c = r["choices"][0]
            text = c["message"]["content"] if path == CHAT else c["text"]
            if c["finish_reason"] == "stop":
                assert isinstance(json.loads(text), dict)
            else:  # the random model may write one long string: the prefix must still be JSON-shaped
                assert text.startswith("{")
            jsonschema.validate({}, schema)


def test_a_schema_the_engine_cannot_compile_is_a_400_naming_the_construct(tiny_base):
    """Fails on the tree before issue 13, which refused every response_format but text by name (not
    re-run); the construct's name comes from llguidance's error."""
    r = httpx.post(
        tiny_base + CHAT, json={"messages": MSG, "response_format": fmt({"type": "object", "not": {}})}
    )
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "unsupported_schema" and err["param"] == "response_format"
    assert '"not"' in err["message"]
    r = httpx.post(tiny_base + CHAT, json={"messages": MSG, "response_format": {"type": "json_schema"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"


def test_the_engines_refusal_is_quoted_whole_on_one_line(tiny_base):
    """QA pass 6: a bad pattern's 400 ended at "regex parse error:" (the detail was on llguidance's
    next lines), and int64 bounds came back as Rust's `min=Some(...)` with no way out. Seen red with
    the old first-line `_reason`."""
    bad = {"type": "string", "pattern": "(["}
    err = httpx.post(tiny_base + CHAT, json={"messages": MSG, "response_format": fmt(bad)}).json()["error"]
    assert "unclosed character class" in err["message"] and "\n" not in err["message"]
    wide = {"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1}
    err = httpx.post(tiny_base + CHAT, json={"messages": MSG, "response_format": fmt(wide)}).json()["error"]
    assert "Some(" not in err["message"] and "narrow minimum/maximum" in err["message"]


def test_a_schema_is_compiled_once_then_served_from_the_cache(tiny_engine, tiny_base):
    """Seen red with the cache lookup removed from GrammarCompiler._template (compiles went up by 2)."""
    comp = compiler_for(tiny_engine.tokenizer, tiny_engine.spec.vocab_size, tiny_engine.plan.limits.grammars)
    schema = {**PERSON, "title": "cache-probe"}
    body = {"messages": MSG, "max_tokens": 60, "response_format": fmt(schema)}
    assert httpx.post(tiny_base + CHAT, json=body, timeout=60).status_code == 200
    before = comp.compiles
    for _ in range(2):
        assert httpx.post(tiny_base + CHAT, json=body, timeout=60).status_code == 200
    assert comp.compiles == before


def test_the_memory_plan_shows_the_grammar_workspace(tiny_engine, tiny_base):
    """Fails without the `grammar` term (KeyError on the breakdown)."""
    plan = tiny_engine.plan
    g = plan.workspace_breakdown["grammar"]
    assert g > 0 and "of which grammar" in plan.describe()
    res = httpx.get(tiny_base + "/v1/resources").json()
    assert res["plan"]["workspace_breakdown"]["grammar"] == g


# ---- the real model ------------------------------------------------------------------------------
@pytest.mark.slow
def test_openai_parse_returns_a_parsed_pydantic_object():
    """`client.chat.completions.parse(response_format=Model)`: the SDK sends a strict json_schema and
    parses the answer into the model. (The pre-issue-13 tree refused response_format: a 400.)"""
    import openai
    from pydantic import BaseModel

    from kvgate.config import EngineConfig
    from kvgate.core.engine import Engine

    class City(BaseModel):
        name: str
        country: str
        population: int

    engine = Engine.from_model("default", EngineConfig(memory_limit="2GiB", max_model_len=2048)).start()
    try:
        with running_server(engine, model_name="SmolLM2-135M-Instruct") as (base, _app):
            client = openai.OpenAI(base_url=base + "/v1", api_key="unused")
            out = client.chat.completions.parse(
                model="SmolLM2-135M-Instruct",
                messages=[
                    {"role": "user", "content": "Describe Paris as JSON with name, country, population."}
                ],
                response_format=City,
                max_tokens=80,
                temperature=0,
            )
            city = out.choices[0].message.parsed
            assert isinstance(city, City) and city.name
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_32_grammar_rows_stay_within_the_memory_plan():
    """The memory probe (tests/memory_probe.py) with 32 rows, each generating under its own JSON
    schema (--max-grammars 32: 32 compiled grammars, the token trie, 32 matchers and masks): the serving peak stays
    within weights + KV + workspace + overhead (measured: 1862 MiB peak against a 2047 MiB plan).
    Not sabotaged by hand (a probe takes ~80 s): with the term at 0 the KV pool would take its room,
    so this checks the total, and test_the_memory_plan_shows_the_grammar_workspace checks the term."""
    from tests.test_memory import COMMON, run_probe, summary

    args = COMMON + ["--max-seqs", "32", "--grammar-rows", "32", "--max-grammars", "32", "--long-decode", "2"]
    args += ["--row-prompt", "8", "--decode", "6", "--max-model-len", "512", "--memory-limit", "2GiB"]
    r = run_probe(args)
    if not r["can_reset_hwm"]:
        pytest.skip("this kernel cannot reset the RSS high-water mark")
    print(summary(r), file=sys.stderr)
    assert r["requests"] == 32 and r["max_rows_seen"] >= 24
    assert r["serving_peak"] - r["weights_dead_rss"] <= r["plan_total"], summary(r)
    assert r["plan"]["workspace_breakdown"]["grammar"] > 0
    assert Path(__file__).exists()


def test_string_length_bounds_fit_the_lexer_or_are_refused_up_front(tiny_engine, tiny_base):
    """QA pass 9's HIGH: pydantic's `max_length=500` was admitted (200 and headers) and then failed
    after ~230 characters, when the grammar's lexer ran out of its 1,024 states: an admitted request
    that did not complete. A bound a grammar can hold now runs to its end, in multi-byte characters
    too (the costliest per character); one it cannot hold is a 400 before admission naming the bound
    and the numbers. Seen red with the old LEXER_STATES (500 does not fit), with STATES_PER_CHAR 4 (the
    lexer ran out within the bound it let through), and with `check_lengths` taken out (maxLength
    2,000 admitted)."""
    from kvgate.structured.compiler import LEXER_STATES, OTHER_STATES, STATES_PER_CHAR

    most = (LEXER_STATES - OTHER_STATES) // STATES_PER_CHAR
    assert most >= 500  # pydantic's common max_length=500 fits
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": most}}, "required": ["s"]}
    grammar = grammar_of(tiny_engine, schema)
    tk = tiny_engine.tokenizer
    for text in ("word " * most, "日本語🙂é" * most):
        m = grammar.matcher()
        ids = tk.encode(json.dumps({"s": text[:most]}, ensure_ascii=False, separators=(", ", ": ")))
        for t in ids:
            m.compute_bitmask()
            assert m.consume_token(t) and not m.is_error(), m.get_error()
        assert m.is_accepting()
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    r = httpx.post(
        tiny_base + CHAT, json={"messages": MSG, "response_format": rf, "max_tokens": 8}, timeout=60
    )
    assert r.status_code == 200, r.text
    big = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 2000}}}
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": big}}
    # max_tokens 400: 400 tokens of at most 13 bytes (the tiny model's longest) can reach 2,000 characters
    r = httpx.post(
        tiny_base + CHAT, json={"messages": MSG, "response_format": rf, "max_tokens": 400}, timeout=60
    )
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "unsupported_schema", r.text
    assert "2,000 at properties.s" in err["message"] and f"{LEXER_STATES:,}" in err["message"]
    # strings of one maxLength but other minLengths are other lexemes (the review: twelve fields of
    # minLength 280..291 under maxLength 300 were counted as one 300 and ran out mid-answer; seen red
    # with the bounds keyed by their largest value)
    fields = {f"f{i}": {"type": "string", "minLength": 280 + i, "maxLength": 300} for i in range(12)}
    rf = {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": {"type": "object", "properties": fields}},
    }
    r = httpx.post(
        tiny_base + CHAT, json={"messages": MSG, "response_format": rf, "max_tokens": 400}, timeout=60
    )
    assert r.status_code == 400 and "3,600 characters" in r.json()["error"]["message"], r.text
    # a pattern's counted repeats cost the same (seen red without COUNTS: admitted)
    counted = {"type": "object", "properties": {"p": {"type": "string", "pattern": "^[a-z]{0,2000}$"}}}
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": counted}}
    r = httpx.post(
        tiny_base + CHAT, json={"messages": MSG, "response_format": rf, "max_tokens": 8}, timeout=60
    )
    assert r.status_code == 400 and "2,000 at properties.p" in r.json()["error"]["message"], r.text


def test_a_max_length_no_output_can_reach_is_no_bound(tiny_engine, tiny_base):
    """A maxLength at or past max_tokens x the longest token's bytes can never bind, so it is not
    enforced and costs no lexer states: such a schema (an agent's "file contents up to 100,000") is
    served instead of refused, and the refusal of one within reach says how far to lower max_tokens.
    Session 45: Claude Code's tools carry maxLength 524,288. Red with `unreachable` always false (the
    first request refused) and with `>` for `>=` (the boundary refused)."""
    per = tiny_engine.tokenizer.longest_token_bytes()

    def ask(max_length: int, max_tokens: int) -> httpx.Response:
        schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": max_length}}}
        rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
        body = {"messages": MSG, "response_format": rf, "max_tokens": max_tokens, "temperature": 0}
        return httpx.post(tiny_base + CHAT, json=body, timeout=60)

    r = ask(100_000, 8)
    assert r.status_code == 200, r.text
    assert ask(100 * per, 100).status_code == 200  # 100 tokens reach 100 x per characters: no bound
    refused = ask(100 * per - 1, 100)
    assert (
        refused.status_code == 400 and f"max_tokens x {per} characters" in refused.json()["error"]["message"]
    )
