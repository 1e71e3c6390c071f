"""Any JSON body sent to /v1/messages is read into a chat body or refused with a 400-class `APIError`,
never another exception (a 500): hypothesis builds bodies from the Messages API's own field and block
names with values of every JSON type. Session 45's review found `{"role": []}` with block content
raising TypeError in the block check; seen red here with that fix undone."""

from __future__ import annotations

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvgate.server import protocol as P
from kvgate.server.chat_messages import chat_messages
from kvgate.server.errors import APIError
from kvgate.server.messages_input import to_chat

KEYS = [
    "model",
    "max_tokens",
    "messages",
    "system",
    "tools",
    "tool_choice",
    "thinking",
    "stop_sequences",
    "stream",
    "temperature",
    "top_p",
    "top_k",
    "metadata",
    "output_config",
    "thread",
    "container",
    "role",
    "content",
    "type",
    "text",
    "id",
    "name",
    "input",
    "tool_use_id",
    "is_error",
    "input_schema",
    "clear_at",
    "cache_control",
    "format",
    "schema",
    "effort",
    "defer_loading",
    "budget_tokens",
]
TYPES = [
    "text",
    "tool_use",
    "tool_result",
    "image",
    "thinking",
    "auto",
    "any",
    "tool",
    "none",
    "object",
    "json_schema",
    "enabled",
    "adaptive",
    "custom",
    "bash_20250124",
]
ROLES = ["user", "assistant", "system", "tool"]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 10**6),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from(TYPES + ROLES + ["", " ", "x", "tiny", "t1"]),
    st.text(max_size=8),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.sampled_from(KEYS), inner, max_size=5),
    ),
    max_leaves=25,
)
turn = st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(ROLES), values)},
    optional={
        "content": st.one_of(
            st.text(max_size=6),
            st.lists(st.dictionaries(st.sampled_from(KEYS), values, max_size=4), max_size=3),
            values,
        )
    },
)
# well-formed pieces in any order and number: the conversation rules and the translation itself
ids = st.sampled_from(["t1", "t2"])
text = st.sampled_from(["", "hi", "It is ", "ok"])
block = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": text}),
    st.fixed_dictionaries(
        {"type": st.just("tool_use"), "id": ids, "name": st.sampled_from(["f", "g"]), "input": st.just({})}
    ),
    st.fixed_dictionaries(
        {"type": st.just("tool_result"), "tool_use_id": ids},
        optional={
            "content": st.one_of(
                text, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}), max_size=2)
            ),
            "is_error": st.booleans(),
        },
    ),
)
shaped_turn = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "assistant", "system"]),
        "content": st.one_of(text, st.lists(block, max_size=3)),
    },
    optional={"clear_at": st.sampled_from(["next_user_message", "never"])},
)
tool = st.fixed_dictionaries(
    {
        "name": st.sampled_from(["f", "g", "bad name"]),
        "input_schema": st.fixed_dictionaries({"type": st.sampled_from(["object", "string"])}),
    }
)
shaped = st.fixed_dictionaries(
    {
        "model": st.just("tiny"),
        "max_tokens": st.integers(0, 8),
        "messages": st.lists(shaped_turn, min_size=1, max_size=5),
    },
    optional={
        "tools": st.lists(tool, max_size=2),
        "tool_choice": st.fixed_dictionaries(
            {"type": st.sampled_from(["auto", "any", "tool", "none"])},
            optional={"name": st.sampled_from(["f", "h"])},
        ),
        "system": st.one_of(
            text, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}), max_size=2)
        ),
        "stop_sequences": st.lists(text, max_size=2),
        "stream": st.booleans(),
    },
)
bodies = st.one_of(
    values,
    shaped,
    st.fixed_dictionaries(
        {
            "model": st.just("tiny"),
            "max_tokens": st.one_of(st.integers(-1, 50), values),
            "messages": st.lists(turn, max_size=4),
        },
        optional={
            k: values
            for k in (
                "system",
                "tools",
                "tool_choice",
                "thinking",
                "stop_sequences",
                "output_config",
                "thread",
            )
        },
    ),
)


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=bodies, count=st.booleans())
def test_any_body_is_read_or_refused_with_a_400(body, count):
    try:
        chat, origin = to_chat(body, count=count)
    except APIError as e:
        assert 400 <= e.status < 500 and e.message, e
        event(f"refused: {e.code}")
        return
    event("read")
    assert isinstance(chat["messages"], list) and len(origin) == len(chat["messages"])
    try:  # the chat path's own reading of the translation: a 400 at most (an empty conversation, ...)
        chat_messages(P.parse(P.ChatCompletionRequest, chat))
    except APIError as e:
        assert e.status == 400, e
        event(f"chat refused: {e.code}")
