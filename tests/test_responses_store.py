"""Kept responses: `previous_response_id`, `GET` / `DELETE /v1/responses/{id}`, `store: false`, and the
store's bound (kvgate/server/responses_store.py, kvgate/server/responses_route.py)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from kvgate.server.responses_store import ResponseStore
from tests.server_util import running_server
from tests.test_responses_api import base, client  # noqa: F401 (a fixture)

GREEDY = dict(model="tiny", temperature=0, max_output_tokens=8)


def test_a_chained_response_sees_the_whole_conversation_and_not_the_earlier_instructions(base):  # noqa: F811
    """Turn 2 named by `previous_response_id` is served exactly as the same conversation sent whole
    (the first input, the first answer replayed, the new input): the same input tokens and the same
    greedy text. Turn 1's instructions are not carried over (OpenAI's rule). Red with the stored
    conversation not put before the input (fewer input tokens)."""
    c = client(base)
    first = c.responses.create(input="my name is Ada", instructions="be terse", **GREEDY)
    second = c.responses.create(input="what is my name?", previous_response_id=first.id, **GREEDY)
    assert second.previous_response_id == first.id and second.store is True
    replay = [{"role": "user", "content": "my name is Ada"}, *[o.model_dump() for o in first.output]]
    whole = c.responses.create(input=[*replay, {"role": "user", "content": "what is my name?"}], **GREEDY)
    assert second.usage.input_tokens == whole.usage.input_tokens
    assert second.output_text == whole.output_text
    # a third turn chains through both
    third = c.responses.create(input="and again?", previous_response_id=second.id, **GREEDY)
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens


def test_get_and_delete_read_and_drop_a_kept_response(base):  # noqa: F811
    """GET gives back the response as it was answered (streamed: as its last event carried it);
    DELETE drops it; then GET is a 404 and chaining on it a 400 naming previous_response_id, each
    saying why and what to do. Red with the stream not kept (404 on the streamed one)."""
    c = client(base)
    whole = c.responses.create(input="hello", **GREEDY)
    got = c.responses.retrieve(whole.id)
    assert got.model_dump() == whole.model_dump()
    with c.responses.stream(input="hello again", **GREEDY) as s:
        final = [e for e in s if e.type in ("response.completed", "response.incomplete")][-1].response
    assert c.responses.retrieve(final.id).model_dump() == final.model_dump()
    deleted = httpx.delete(f"{base}/v1/responses/{whole.id}", timeout=10).json()
    assert deleted == {"id": whole.id, "object": "response", "deleted": True}
    with pytest.raises(openai.NotFoundError) as e:
        c.responses.retrieve(whole.id)
    assert e.value.body["code"] == "response_not_found" and "deleted" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(input="x", previous_response_id=whole.id, **GREEDY)
    assert (e.value.body["code"], e.value.body["param"]) == (
        "previous_response_not_found",
        "previous_response_id",
    )
    assert "Send the whole conversation in input" in e.value.body["message"]
    assert httpx.delete(f"{base}/v1/responses/{whole.id}", timeout=10).status_code == 404


def test_store_false_keeps_nothing_and_says_so(base):  # noqa: F811
    c = client(base)
    r = c.responses.create(input="hello", store=False, **GREEDY)
    assert r.store is False
    assert httpx.get(f"{base}/v1/responses/{r.id}", timeout=10).status_code == 404


def test_an_error_in_the_new_input_names_its_own_index_not_the_merged_one(base):  # noqa: F811
    """Red with `_own_index` out (the param would count the earlier turn's items: input.3.role)."""
    c = client(base)
    first = c.responses.create(input="hello", **GREEDY)
    bad = [{"role": "user", "content": "a"}, {"role": "wizard", "content": "b"}]
    r = httpx.post(
        f"{base}/v1/responses",
        json={**GREEDY, "input": bad, "previous_response_id": first.id},
        timeout=10,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "input.1.role", r.text
    assert r.json()["error"]["message"].startswith("input[1].role 'wizard'")


def test_the_store_is_bounded_by_its_bytes_least_recently_used_out_first():
    """Three responses of ~1 KB in a 2.5 KB store: the oldest goes; reading one makes it the newest, so
    the next eviction takes the other. The bytes counted are the JSON kept. Red with the read not
    moving the entry (the read one evicted)."""
    store = ResponseStore(2500)

    def resp(i):
        return {"id": f"resp_{i}", "output": [{"type": "message", "text": "x" * 900}]}

    assert store.put(resp(1), [{"role": "user", "content": "a"}])
    assert store.put(resp(2), [])
    store.get("resp_1")
    assert store.put(resp(3), [])
    assert store.get("resp_2") is None and store.get("resp_1") is not None and store.evicted == 1
    kept = [
        json.dumps(x, separators=(",", ":"))
        for x in (resp(1), [{"role": "user", "content": "a"}], resp(3), [])
    ]
    assert store.bytes == sum(len(k) for k in kept)
    assert store.summary() == {"limit_bytes": 2500, "bytes": store.bytes, "responses": 2, "evicted": 1}
    assert not store.put({"id": "big", "output": "y" * 3000}, [])  # larger than the store: not kept
    assert store.summary()["responses"] == 2


def test_with_the_store_off_nothing_is_kept_and_chaining_says_how_to_turn_it_on(make_engine):
    e = make_engine()
    with running_server(e, responses_store_bytes=0) as (b, _app):
        r = httpx.post(f"{b}/v1/responses", json={**GREEDY, "input": "hi"}, timeout=30).json()
        assert r["store"] is False
        again = httpx.post(
            f"{b}/v1/responses", json={**GREEDY, "input": "x", "previous_response_id": r["id"]}
        )
        assert again.status_code == 400 and "--responses-store 0" in again.json()["error"]["message"]
        store = httpx.get(f"{b}/v1/resources", timeout=10).json()["responses_store"]
        assert store == {"limit_bytes": 0, "bytes": 0, "responses": 0, "evicted": 0}
