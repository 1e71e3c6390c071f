"""The Jinja environment a model's chat template renders in: the one transformers' `apply_chat_template`
builds (and so vLLM's), because templates are written and checked against it.

A plain `ImmutableSandboxedEnvironment` differs from it in ways real templates meet (docs/DESIGN_NOTES.md,
session 47):
- `tojson` is Jinja's HTML-safe one: it sorts keys and writes `<`, `>`, `&`, `'` and every non-ASCII
  character as `\\uXXXX`, so Llama 3.x, Qwen2.5/3 and Mistral templates showed the model its tools
  and its own earlier calls in an order and spelling it was never trained on. Here it is `json.dumps`
  with transformers' options and defaults (`ensure_ascii=False`, `indent`, `separators`, `sort_keys`).
- `{% break %}` / `{% continue %}` need the loopcontrols extension (without it the template does not
  even compile), and `{% generation %}...{% endgeneration %}` (training templates mark the assistant's
  tokens with it) is transformers' own tag; here it renders its body.
- globals: `raise_exception`, `strftime_now`, and transformers' `dict` and `namespace`, which refuse
  what a sandbox escape would need (a `namespace` attribute whose name starts with `_`).

`nine_char_ids`: Mistral's templates (Nemo, Small 3.x) refuse a tool call id that is not 9 characters
long, so a conversation that replays kvgate's own calls (`call_` and 24 hex digits), or OpenAI's, was a
400 there.
"""

from __future__ import annotations

import hashlib
import json
import re
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.utils
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

# what a template's own failure may raise besides TemplateError (vLLM answers these with a 400 too):
# `'a' + dict`, a missing key, `int('x')`, ...
RENDER_ERRORS = (jinja2.TemplateError, TypeError, ValueError, LookupError, RuntimeError)


# a template that checks `id|length != 9` (Mistral's) takes only such ids
NINE_CHAR_IDS = re.compile(r"length\s*!=\s*9\b")


def nine_char_ids(messages: list[dict]) -> list[dict]:
    """The messages with every tool call id, and every answer's `tool_call_id`, 9 characters long, each
    id rewritten alike wherever it occurs: kept when it is 9 letters and digits, else its last 9
    characters when those are (vLLM's rule for Mistral's tokenizers), else 9 hex digits of its hash."""

    def short(i):
        if not isinstance(i, str) or (len(i) == 9 and i.isalnum()):
            return i
        return i[-9:] if len(i) > 9 and i[-9:].isalnum() else hashlib.sha256(i.encode()).hexdigest()[:9]

    out = []
    for m in messages:
        if m.get("tool_calls"):
            m = {**m, "tool_calls": [{**c, "id": short(c.get("id"))} for c in m["tool_calls"]]}
        if "tool_call_id" in m:
            m = {**m, "tool_call_id": short(m["tool_call_id"])}
        out.append(m)
    return out


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def raise_exception(message: str):
    raise jinja2.TemplateError(message)


def strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Generation(jinja2.ext.Extension):
    """`{% generation %}body{% endgeneration %}`: the body, as transformers renders it (a call block,
    so a `set` inside stays inside)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller) -> str:
        return caller()


class _Dict:
    """`dict(...)` and `dict.fromkeys(...)`, and nothing else of the type."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """A `namespace()` whose attributes may not start with `_`."""

    def __init__(*args, **kwargs):  # Jinja's signature trick: `namespace(self=...)` still works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a namespace attribute may not start with '_': {name!r}")


def template_env() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals.update(
        raise_exception=raise_exception, strftime_now=strftime_now, dict=_Dict(), namespace=_Namespace
    )
    return env
