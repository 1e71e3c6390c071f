"""Tokenizer, chat-template rendering and incremental detokenization.

`IncrementalDetokenizer` emits text only once it is final: it decodes a short window of recent tokens
and releases the new part only when it does not end in U+FFFD, so a multibyte character split across
tokens is never emitted half-way. Whatever is still pending at the end is flushed, except an
incomplete character that generation stopped in the middle of (vLLM drops it too): its bytes decode
only to U+FFFD. A U+FFFD the model wrote whole (its three bytes) is text like any other and is kept.

`token_bytes(id)` is a token's exact bytes (what OpenAI's logprobs report), which a text decode of
one token cannot give when the token is part of a multibyte character: byte-level vocabularies map
their symbols back through GPT-2's byte alphabet, SentencePiece ones read `<0xNN>` and `▁`.
"""

from __future__ import annotations

import codecs
import json
import logging

from tokenizers import Tokenizer

from kvgate.chat_env import NINE_CHAR_IDS, RENDER_ERRORS, nine_char_ids, template_env
from kvgate.models.hf_loader import TokenizerInfo

log = logging.getLogger("kvgate.tokenizer")

# Used when a model ships no chat template: ChatML, the most common instruct format.
FALLBACK_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ChatTemplateError(ValueError):
    pass


class TextTokenizer:
    def __init__(self, info: TokenizerInfo):
        self.tok = Tokenizer.from_str(info.tokenizer_json)
        self.info = info
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self.eog_ids = frozenset(info.eog_token_ids)
        if not info.chat_template:
            log.warning(
                "the model ships no chat template: /v1/chat/completions formats messages as ChatML "
                "(<|im_start|>role ... <|im_end|>), which may not be the format it was trained on; "
                "/v1/completions sends prompts as given"
            )
        self._template = template_env().from_string(info.chat_template or FALLBACK_TEMPLATE)
        # a template that reads `tools` renders tool definitions itself (kvgate.server.tools)
        self.supports_tools = "tools" in (info.chat_template or "")
        self._nine_char_ids = bool(NINE_CHAR_IDS.search(info.chat_template or ""))  # Mistral's
        self._bytes: list[bytes] | None = None
        self._longest: int | None = None
        spec = json.loads(info.tokenizer_json)
        added = spec.get("added_tokens", [])
        self._added = {a["id"]: a["content"] for a in added}
        self._skipped = frozenset(a["id"] for a in added if a.get("special"))  # what decode() leaves out
        self._byte_level = "ByteLevel" in json.dumps(spec.get("decoder") or {})

    def token_text(self, token_id: int) -> str | None:
        return self.tok.id_to_token(token_id)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        # encode_batch releases the GIL while it works; encode holds it: measured on 1 MiB of text,
        # 0.87 s with every other thread (the event loop) stalled for 0.82 s, against 0.65 s and 10 ms.
        ids = self.tok.encode_batch([text], add_special_tokens=False)[0].ids
        bos = self.info.bos_token_id
        if (self.info.add_bos_token if add_bos is None else add_bos) and bos is not None:
            if not ids or ids[0] != bos:
                ids = [bos, *ids]
        return ids

    def decode(
        self, ids: list[int], skip_special_tokens: bool = True, keep: frozenset[int] = frozenset()
    ) -> str:
        """`keep`: special tokens written out though the others are skipped (a tool format's markers)."""
        if skip_special_tokens and keep:
            ids = [i for i in ids if i in keep or i not in self._skipped]
            skip_special_tokens = False
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def render_chat(
        self, messages: list[dict], add_generation_prompt: bool = True, tools=None, variables=None
    ) -> str:
        """`variables`: more template variables (a request's `chat_template_kwargs`). `tools` and
        `documents` are always defined, None when there are none, as transformers passes them (a
        template may test `tools is not none`)."""

        def name(i):
            return None if i is None else self.tok.id_to_token(i)

        extra = {"tools": tools or None, "documents": None, **(variables or {})}
        if self._nine_char_ids:
            messages = nine_char_ids(messages)
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=name(self.info.bos_token_id) or "",
                eos_token=name(self.info.eos_token_id) or "",
                **extra,
            )
        except RENDER_ERRORS as exc:  # the template's own failure on these messages (`'a' + dict` too)
            raise ChatTemplateError(f"the model's chat template rejected these messages: {exc}") from exc

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes of one token (the table is built on first use: call it off the event loop)."""
        if self._bytes is None:
            self._bytes = [self._piece_bytes(i) for i in range(self.vocab_size)]
        return self._bytes[token_id] if 0 <= token_id < len(self._bytes) else b""

    def longest_token_bytes(self) -> int:
        """The most bytes one token decodes to: no output of n tokens has more characters than n times
        this (read once: every structured request asks)."""
        if self._longest is None:
            self.token_bytes(0)
            self._longest = max(map(len, self._bytes), default=1)
        return self._longest

    def broken_tail(self, ids: list[int]) -> int:
        """How many characters at the end of `decode(ids)` stand for an incomplete UTF-8 character
        (its first bytes, which a later token would have completed): 0 when the text ends whole.
        A byte-level vocabulary decodes them lossily to one U+FFFD, a byte-fallback one to one each."""
        data = b"".join(self._piece_bytes(i) for i in ids if i not in self._skipped)
        dec = codecs.getincrementaldecoder("utf-8")("replace")
        dec.decode(data, final=False)
        pending = len(dec.getstate()[0])
        return min(pending, 1) if self._byte_level else pending

    def _piece_bytes(self, i: int) -> bytes:
        piece = self.tok.id_to_token(i)
        if piece is None:
            return b""
        if i in self._added:
            return self._added[i].encode()
        if self._byte_level and all(c in _BYTE_OF for c in piece):
            return bytes(_BYTE_OF[c] for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode()

    def chat_ids(
        self,
        messages: list[dict],
        tools=None,
        add_generation_prompt=True,
        continue_final=False,
        variables=None,
    ) -> list[int]:
        """`continue_final`: the final message is left open (its text cut right after its content), so
        the answer continues it (kvgate.server.chat_template)."""
        text = self.render_chat(messages, add_generation_prompt, tools, variables)
        if continue_final:
            content = messages[-1]["content"]
            at = text.rfind(content) if content else -1
            if at < 0:
                raise ChatTemplateError(
                    "continue_final_message: the chat template did not write the final message's content "
                    "as sent, so there is no place to continue it from; send continue_final_message: false"
                )
            text = text[: at + len(content)]
        # The template writes BOS itself when the model wants one; never add a second.
        bos = self.token_text(self.info.bos_token_id) if self.info.bos_token_id is not None else None
        return self.encode(text, add_bos=False if bos and text.startswith(bos) else None)


def _gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's printable stand-in for each byte (what byte-level BPE vocabularies are written in)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars


_BYTE_OF = _gpt2_byte_decoder()


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: TextTokenizer,
        prompt_ids: list[int],
        context: int = 6,
        skip_special: bool = True,
        keep: frozenset[int] = frozenset(),
    ):
        self.tok = tokenizer
        self.ids = list(prompt_ids[-context:])
        self.prefix = 0
        self.read = len(self.ids)
        self.skip_special = skip_special  # false: special tokens are written out (vLLM's skip_special_tokens)
        self.keep = keep  # special tokens written out all the same (`TextTokenizer.decode`)

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip_special, keep=self.keep)

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        before = self._decode(self.ids[self.prefix : self.read])
        after = self._decode(self.ids[self.prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before) :]
        return ""

    def flush(self) -> str:
        """The held-back text, less an incomplete character at its very end (see the module doc)."""
        window = self.ids[self.prefix :]
        before = self._decode(self.ids[self.prefix : self.read])
        after = self._decode(window)
        self.prefix = self.read = len(self.ids)
        broken_tail = getattr(self.tok, "broken_tail", None)  # a decode-only tokenizer keeps it
        if broken_tail is not None and after.endswith("\ufffd"):
            after = after[: len(after) - broken_tail(window)]
        return after[len(before) :] if len(after) > len(before) else ""
