"""Kept responses: `previous_response_id`, `GET` / `DELETE /v1/responses/{id}`, `store: false`, and the
store's bound (kvgate/server/responses_store.py, kvgate/server/responses_route.py)."""

from __future__ import annotations

import httpx
import openai
import pytest

from kvgate.server.responses_store import ENTRY_BYTES, ITEM_BYTES, ResponseStore
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
    """Three responses of ~1 KB in a 3 KB store (each also counts ENTRY_BYTES): the oldest goes; reading one makes it the newest, so
    the next eviction takes the other. The bytes counted are the JSON kept. Red with the read not
    moving the entry (the read one evicted)."""
    store = ResponseStore(3000)

    def resp(i):
        return {"id": f"resp_{i}", "output": [{"type": "message", "text": "x" * 900}]}

    assert store.put(resp(1), [{"role": "user", "content": "a"}])
    assert store.put(resp(2), [])
    store.get("resp_1")
    assert store.put(resp(3), [])
    assert store.get("resp_2") is None and store.get("resp_1") is not None and store.evicted == 1
    held = sum(
        len(a) + len(b) + ENTRY_BYTES + sum(ITEM_BYTES + 2 * len(i) for i in ids)
        for a, b, ids in store._items.values()
    )
    assert store.bytes == held  # what is held
    assert store.get("resp_1")[1][0]["id"].startswith("msg_")  # an item sent without an id gets one
    assert store.summary() == {"limit_bytes": 3000, "bytes": store.bytes, "responses": 2, "evicted": 1}
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


def test_input_items_lists_the_conversation_in_pages_as_the_sdk_reads_it(base):  # noqa: F811
    """Two chained turns: turn 2's input items are turn 1's input, turn 1's output and turn 2's input,
    newest first by default, each with an id and typed parts; the SDK's pager walks them 2 at a time
    with `after`. Red with the store not giving ids to items sent without one (the pager cannot go on)."""
    c = client(base)
    first = c.responses.create(input="one", **GREEDY)
    second = c.responses.create(
        input=[{"role": "user", "content": "two"}], previous_response_id=first.id, **GREEDY
    )
    items = list(c.responses.input_items.list(second.id, limit=2))
    assert len(items) == 3 and len({i.id for i in items}) == 3
    assert [i.type for i in items] == ["message", "message", "message"]
    assert items[0].content[0].text == "two" and items[2].content[0].text == "one"
    assert items[1].id == first.output[0].id  # turn 1's answer, as it was given
    oldest = c.responses.input_items.list(second.id, order="asc", limit=1)
    assert oldest.data[0].id == items[2].id and oldest.has_more
    bad = httpx.get(f"{base}/v1/responses/{second.id}/input_items", params={"limit": 0}, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "limit"


def test_what_a_kept_response_cannot_do_is_said_not_dropped(base):  # noqa: F811
    """GET with stream=true (the SDK's retrieve(stream=True) got an empty stream), cancel (only
    background responses), a trailing slash (a bare 307), an id of 50,000 characters (a 100 KB
    error), and a continuation without input (OpenAI's input is optional then). Red with each
    check taken out of the route (QA pass 5's F4-F7)."""
    c = client(base)
    r = c.responses.create(input="hi", **GREEDY)
    got = httpx.get(f"{base}/v1/responses/{r.id}", params={"stream": "true"}, timeout=10)
    assert got.status_code == 400 and got.json()["error"]["param"] == "stream"
    with pytest.raises(openai.BadRequestError, match="only those can be cancelled"):
        c.responses.cancel(r.id)
    slash = httpx.get(f"{base}/v1/responses/", timeout=10)
    assert slash.status_code in (404, 405) and "error" in slash.json()
    huge = httpx.get(f"{base}/v1/responses/resp_{'a' * 50_000}", timeout=10)
    assert huge.status_code == 404 and len(huge.text) < 1000 and "50005 characters" in huge.text
    assert "Send the whole conversation" not in huge.text  # advice for continuations only
    for body in ({}, {"input": None}):
        more = httpx.post(
            f"{base}/v1/responses", json={**GREEDY, "previous_response_id": r.id, **body}, timeout=30
        )
        assert more.status_code == 200, more.text


def test_a_response_larger_than_the_store_says_store_false(tmp_path):
    """Whole and streamed. Red with `kept` ignoring put's answer (store: true, then a 404)."""
    from kvgate.config import EngineConfig
    from kvgate.core.engine import Engine
    from tests.tiny_model import make_tiny_hf_dir

    d = make_tiny_hf_dir(tmp_path / "tiny4k", geometry={"max_pos": 4096})
    cfg = EngineConfig(kv_cache_bytes=32 << 20, memory_limit="2GiB", dtype="float32", device="cpu")
    e = Engine.from_model(str(d), cfg, overhead_bytes=0).start()
    with running_server(e, responses_store_bytes=3000) as (b, _app):
        big = {**GREEDY, "input": "word " * 700}
        r = httpx.post(f"{b}/v1/responses", json=big, timeout=60).json()
        assert r["store"] is False
        small = httpx.post(f"{b}/v1/responses", json={**GREEDY, "input": "hi"}, timeout=60).json()
        assert small["store"] is True
        with client(b).responses.stream(**{k: v for k, v in big.items()}) as s:
            final = [x for x in s if x.type in ("response.completed", "response.incomplete")][-1].response
        assert final.store is False
        assert httpx.get(f"{b}/v1/responses/{final.id}", timeout=10).status_code == 404
    e.shutdown()


def test_an_item_sent_with_type_null_is_listed_as_a_message():
    """Red with the type defaulted only when absent (listed as type null)."""
    from kvgate.server.responses_store import listed

    item = listed({"type": None, "role": "user", "content": "hi", "id": "msg_1"})
    assert item["type"] == "message" and item["content"] == [{"type": "input_text", "text": "hi"}]


def test_item_references_are_the_kept_items_they_name(base):  # noqa: F811
    """QA pass 9's HIGH: the AI SDK's OpenAI provider (store on, its default) sends an earlier turn's
    assistant items as `{"type": "item_reference", "id": "msg_..."}`, and kvgate refused every second
    turn. A reference now stands for the kept item it names, input or output, so the turn is served
    as the same conversation sent whole; an id no kept response holds is a 400 naming the reference
    and saying what to send; a deleted response's items go with it. Seen red with `referenced` taken
    out (400 unsupported 'item_reference' items)."""
    c = client(base)
    first = c.responses.create(input=[{"role": "user", "content": "my name is Ada"}], **GREEDY)
    said = first.output[0].id
    asked = [{"type": "item_reference", "id": said}, {"role": "user", "content": "what is my name?"}]
    ref = c.responses.create(
        input=[{"role": "user", "content": "my name is Ada"}, *asked[:1], asked[1]], **GREEDY
    )
    whole = c.responses.create(
        input=[{"role": "user", "content": "my name is Ada"}, first.output[0].model_dump(), asked[1]],
        **GREEDY,
    )
    assert ref.usage.input_tokens == whole.usage.input_tokens and ref.output_text == whole.output_text
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(input=[{"type": "item_reference", "id": "msg_nope"}, asked[1]], **GREEDY)
    assert (e.value.body["code"], e.value.body["param"]) == ("item_not_found", "input.0.id")
    assert "Send the item itself instead" in e.value.body["message"]
    r = httpx.post(
        f"{base}/v1/responses", json={**GREEDY, "input": [{"type": "item_reference", "id": {}}]}, timeout=60
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "input.0.id", r.text  # schemathesis: a 500
    for kept in (ref, whole, first):  # every response holding the item: then it is gone
        httpx.delete(f"{base}/v1/responses/{kept.id}", timeout=10)
    with pytest.raises(openai.BadRequestError):
        c.responses.create(input=asked, **GREEDY)


def test_the_sdks_parse_output_replays_as_input(base):  # noqa: F811
    """QA pass 9's HIGH: `responses.parse()` adds `parsed` to output text parts and `parsed_arguments`
    to function calls, and the documented loop `input.push(...response.output)` sent them back: a 400
    naming another field. They are accepted and unused. Seen red without the two fields (400)."""
    c = client(base)
    item = {
        "type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
        "content": [{"type": "output_text", "text": '{"a": 1}', "annotations": [], "parsed": {"a": 1}}],
    }  # fmt: skip
    call = {
        "type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"x": 1}',
        "parsed_arguments": {"x": 1}, "id": "fc_1", "status": "completed",
    }  # fmt: skip
    out = {"type": "function_call_output", "call_id": "c1", "output": "ok"}
    got = c.responses.create(input=[{"role": "user", "content": "hi"}, item, call, out], **GREEDY)
    assert got.status in ("completed", "incomplete")


def test_an_item_stays_found_while_any_kept_response_holds_it():
    """The review of session 36: the index pointed an item at the last response kept with it, and
    dropped it when that one went, though an earlier kept response (a chained conversation keeps every
    earlier item again) still held it. Seen red with one holder an item."""
    store = ResponseStore(1 << 20)
    item = {"type": "message", "role": "user", "content": "hi", "id": "msg_x"}
    store.put({"id": "resp_a", "output": []}, [item])
    store.put({"id": "resp_b", "output": []}, [item])
    store.delete("resp_b")
    assert store.item("msg_x") == item
    store.delete("resp_a")
    assert store.item("msg_x") is None and store._holders == {}
