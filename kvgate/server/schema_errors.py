"""Pydantic's validation errors as one message that names what failed, and the field it belongs to.

A field typed as a union (`prompt`, `tool_choice`, `stop`, a message's `content`, ...) fails once per
member, and pydantic lists every member's failure in the union's order: the first is rarely the one to
show ("Input should be 'none', 'auto' or 'required'" for a `tool_choice` object that lacks
`function`). `describe` reports the member that got furthest (the one whose failures lie deepest
inside the value: the shape the client meant), names its failures by path, and says which shapes the
field takes, with the usual mistake for `tool_choice` (the Responses API's shape) and `prompt` (a batch
mixing strings and token-id lists). The path it returns names fields only, never pydantic's union-member
tags ("str", "list[int]", "NamedToolChoice"), and it is the union field itself for a union's failure.
"""

from __future__ import annotations

_SIMPLE_TAGS = {"str", "int", "float", "bool", "list", "dict"}

# what each union-typed field takes, by its name (the last field of its path)
SHAPES = {
    "tool_choice": '"none", "auto", "required", or {"type": "function", "function": {"name": "..."}} '
    '(the chat shape: {"type": "function", "name": "..."} is the Responses API\'s)',
    "prompt": "a string, a list of strings, a list of token ids, or a list of token-id lists (a batch is "
    "all strings or all token-id lists)",
    "content": 'a string, a list of text parts ({"type": "text", "text": "..."}), or null',
    "stop": "a string, a list of strings, or null",
    "logprobs": "a boolean (chat) or an integer (completions), or null",
}


MAX_OTHER_PROBLEMS = 4  # named after the first in a 400; past that, counted


def describe(errors: list[dict], tags: frozenset[str] = frozenset()) -> tuple[str, str]:
    """(message, the field's path) for pydantic's `exc.errors()`: the first problem, then up to
    MAX_OTHER_PROBLEMS others as "'path': why" (a client fixes them all in one round trip); `tags` are
    the model class names that may appear as union-member tags in a path."""
    msg, path, others = _first(errors, tags)
    shown = others[:MAX_OTHER_PROBLEMS]
    tail = f"; also {'; '.join(shown)}" if shown else ""
    if len(others) > len(shown):
        tail += f" (and {len(others) - len(shown)} more)"
    return msg + tail, path


def _first(errors: list[dict], tags: frozenset[str]) -> tuple[str, str, list[str]]:
    """(the first problem's message, its field's path, the others as "'path': why")."""

    def is_tag(part) -> bool:
        return isinstance(part, str) and (part in _SIMPLE_TAGS or "[" in part or part in tags)

    first = errors[0]
    loc = tuple(first["loc"])
    cut = next((i for i, p in enumerate(loc) if is_tag(p)), None)
    if cut is None:
        path = _path(loc, is_tag)
        return f"invalid field '{path}': {first['msg']}", path, _others(errors[1:], is_tag)
    field = loc[:cut]
    path = _path(field, is_tag)
    group = [
        e for e in errors if tuple(e["loc"][:cut]) == field and len(e["loc"]) > cut and is_tag(e["loc"][cut])
    ]
    members: dict[str, list[dict]] = {}
    for e in group:
        members.setdefault(e["loc"][cut], []).append(e)
    # the member that got furthest into the value; on a tie, the one with fewer failures
    best = max(members.values(), key=lambda es: (max(len(e["loc"]) for e in es), -len(es)))
    name = next((p for p in reversed(field) if isinstance(p, str)), "")
    shapes = SHAPES.get(name)
    if all(len(e["loc"]) == cut + 1 for e in best):  # no member took the value's type at all
        if shapes:
            detail = f"must be {shapes}"
        else:
            msgs = list(dict.fromkeys(e["msg"].removeprefix("Input should be ") for e in group))
            detail = "Input should be " + " or ".join(msgs)
    else:
        mix = _mixed(next((e.get("input") for e in group if len(e["loc"]) == cut + 1), None))
        parts = [mix] if mix else [_what(_path(e["loc"], is_tag), e) for e in best[:3]]
        detail = "; ".join(parts) + (f". {name} must be {shapes}" if shapes else "")
    rest = [e for e in errors if e not in group]
    return f"invalid field '{path}': {detail}", path, _others(rest, is_tag)


def _others(errors: list[dict], is_tag) -> list[str]:
    """The other failures, one "'path': why" for each field, in pydantic's order: a union field fails
    once per member, and "'stop': a valid string; 'stop': a valid list" would read as two demands."""
    by_path: dict[str, str] = {}
    for e in errors:
        path = _path(e["loc"], is_tag)
        by_path.setdefault(path, _what(path, e))
    return list(by_path.values())


def _what(path: str, e: dict) -> str:
    if e["type"] == "missing":
        return f"'{path}' is missing"
    if e["type"] == "extra_forbidden":
        return f"'{path}' is not a field here"
    return f"'{path}': {e['msg']}"


_KINDS = {str: "strings", int: "integers", float: "numbers", list: "lists", dict: "objects", bool: "booleans"}


def _mixed(value) -> str | None:
    """For a list that mixes kinds of items (a batch prompt of strings and token-id lists): says so,
    without echoing the value."""
    if not isinstance(value, list):
        return None
    kinds = sorted({_KINDS.get(type(x), "nulls" if x is None else "other values") for x in value})
    if len(kinds) < 2:
        return None
    return f"the list mixes {' and '.join(kinds)}, and a list must hold one kind of item"


def _path(loc, is_tag) -> str:
    return ".".join(str(p) for p in loc if not is_tag(p)) or "body"
