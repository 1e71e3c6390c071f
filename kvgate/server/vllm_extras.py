"""vLLM's per-request extras that RL, evaluation and multi-tenant clients send, for chat and completions.

- `truncate_prompt_tokens: N` keeps the last N tokens of the (rendered) prompt, as vLLM's generate
  runners truncate from the left; `-1` keeps as many as the context holds beside max_tokens. More than
  the context minus max_tokens is a 400 with the numbers. Usage counts the tokens kept.
- `allowed_token_ids`: only these ids may be drawn (every other logit is -inf); empty or outside the
  vocabulary is a 400, and so is a step where they (or `bad_words`) leave nothing the grammar or
  `min_tokens` allows (`kvgate.sampling.NoTokenLeft`, answered by `sse.failure_error`).
- `bad_words`: each word is banned as a token sequence, written alone and after a space (the second
  only where it tokenizes to as many tokens with another first token, vLLM's rule); a sequence's last
  token is -inf whenever the output so far ends with the rest of it (a one-token word: always). At most
  `MAX_BAD_WORDS` words of at most `MAX_BAD_WORD_CHARS` characters each, `MAX_BAD_WORD_TOKENS` tokens
  in all.
- `cache_salt`: prompts with different salts never share prefix-cache blocks (vLLM's guard against a
  tenant timing another's cached prompt): the salt roots the chain of block hashes. A non-empty string
  of at most 1,024 characters (vLLM's field limit; its newer rule against '/', '@' and '\\' is not kept:
  a base64 salt, as vLLM's own docs suggest, holds a '/' about half the time, and the characters mean
  nothing to a hash).
- `include_stop_str_in_output`: the stop string that ended a choice stays in its text (text after it in
  the same token does not); a stop token's own text too (the model's end token writes none unless
  `skip_special_tokens` is false).
- `return_token_ids`: the prompt's ids (`prompt_token_ids`: chat at the top, completions per choice)
  and each choice's generated ids (`token_ids`, its stop token included, and its logprobs entry with
  them: `GenerationRequest.report_stop_token`), streamed as each chunk's new ids with the prompt's on
  each choice's first chunk.
- `return_tokens_as_token_ids`: logprobs name tokens `token_id:<id>`, the stop token's included; their
  `bytes` and text offsets stay the tokens' own (vLLM gives the placeholder's in some places).
- `spaces_between_special_tokens`: kvgate's tokenizer never writes spaces between special tokens, so
  true and false give the same text here.
"""

from __future__ import annotations

from pydantic import BaseModel

from kvgate.server.errors import invalid

MAX_BAD_WORDS = 64
MAX_BAD_WORD_CHARS = 256
MAX_BAD_WORD_TOKENS = 1024  # all sequences together, as vLLM's second model runner caps them
MAX_SALT_CHARS = 1024


class VllmExtras(BaseModel):
    """The request fields, for chat and completions (`kvgate.server.protocol._Common`)."""

    truncate_prompt_tokens: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    cache_salt: str | None = None
    include_stop_str_in_output: bool = False
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    spaces_between_special_tokens: bool = True


def check_extras(req: VllmExtras) -> None:
    """The checks that need no tokenizer: ranges and sizes."""
    t = req.truncate_prompt_tokens
    if t is not None and t < -1:
        raise invalid(
            f"truncate_prompt_tokens={t} must be -1 (as much as fits), 0 or more, or unset",
            param="truncate_prompt_tokens",
        )
    if req.allowed_token_ids is not None and not req.allowed_token_ids:
        raise invalid(
            "allowed_token_ids is empty: no token could be drawn. Send at least one id, or leave it out",
            param="allowed_token_ids",
        )
    words = req.bad_words or []
    if len(words) > MAX_BAD_WORDS:
        raise invalid(f"bad_words has {len(words)} entries; at most {MAX_BAD_WORDS}", param="bad_words")
    for w in words:
        if not w.strip():
            raise invalid(
                "bad_words entries must hold a word: an empty or blank one bans nothing", "bad_words"
            )
        if len(w) > MAX_BAD_WORD_CHARS:
            raise invalid(
                f"a bad_words entry is {len(w)} characters; at most {MAX_BAD_WORD_CHARS}", param="bad_words"
            )
    s = req.cache_salt
    if s is not None and not 0 < len(s) <= MAX_SALT_CHARS:
        raise invalid(
            f"cache_salt must be a non-empty string of at most {MAX_SALT_CHARS} characters (got {len(s)})",
            param="cache_salt",
        )


def truncated(
    prompts: list[list[int]], keep: int | None, max_tokens: int | None, context: int
) -> list[list[int]]:
    """Each prompt's last `keep` tokens (`truncate_prompt_tokens`); -1: as many as the context holds
    beside `max_tokens` (at least one position for output when max_tokens is unset)."""
    if keep is None:
        return prompts
    given = max_tokens is not None and max_tokens >= 1  # a bad max_tokens is its own 400, after this
    room = context - (max_tokens if given else 1)
    if keep == -1:
        keep = room
        if room < 1:  # the output alone fills the context: no prompt fits beside it
            raise invalid(
                f"truncate_prompt_tokens=-1 keeps as much prompt as fits beside max_tokens={max_tokens}, and "
                f"the context ({context} positions, --max-model-len) leaves none: lower max_tokens below "
                f"{context}",
                param="max_tokens",
            )
    if keep > room:
        out = f"max_tokens={max_tokens}" if given else "one position of output"
        raise invalid(
            f"truncate_prompt_tokens={keep} is more than the context ({context} positions, --max-model-len) "
            f"less {out}: at most {max(room, 0)}. Send a smaller value, or -1 for as many as fit",
            param="truncate_prompt_tokens",
        )
    if keep == 0:
        raise invalid(
            "truncate_prompt_tokens=0 keeps no prompt, and a request needs at least one prompt token: send 1 "
            "or more, -1 for as many as fit, or leave it out",
            param="truncate_prompt_tokens",
        )
    return [ids[len(ids) - keep :] for ids in prompts]


def bad_word_ids(tok, words: list[str] | None) -> list[list[int]] | None:
    """vLLM's token sequences of `bad_words`: each word alone, and after a space where that tokenizes to
    as many tokens with another first token."""
    if not words:
        return None
    out: list[list[int]] = []
    for w in words:
        bare = tok.encode(w.lstrip(), add_bos=False)
        spaced = tok.encode(" " + w.lstrip(), add_bos=False)
        for seq in (bare, spaced) if len(spaced) == len(bare) and spaced[0] != bare[0] else (bare,):
            if seq not in out:
                out.append(seq)
    total = sum(map(len, out))
    if total > MAX_BAD_WORD_TOKENS:
        raise invalid(
            f"bad_words come to {total} tokens ({len(out)} sequences, each word alone and after a space); "
            f"at most {MAX_BAD_WORD_TOKENS}: send fewer or shorter words",
            param="bad_words",
        )
    return out


def add_token_ids(body: dict, prepared, results) -> None:
    """`return_token_ids` on a whole body: the prompt's ids (chat: at the top; completions: on each
    choice, its own prompt's) and each choice's generated ids, its stop token included."""
    gens = prepared.generations
    if prepared.kind == "chat":
        body["prompt_token_ids"] = gens[0].prompt_ids
    for i, (choice, res) in enumerate(zip(body["choices"], results, strict=True)):
        if prepared.kind != "chat" and prompt_ids_on(prepared, i):  # shared by its choices, not copied
            choice["prompt_token_ids"] = gens[i // prepared.n].prompt_ids
        choice["token_ids"] = res.token_ids


def prompt_ids_on(prepared, i: int) -> bool:
    """Whether text completion choice `i` carries its prompt's ids (`Prepared.prompt_ids_out`)."""
    mode = getattr(prepared, "prompt_ids_out", "all")
    return mode == "all" or (mode == "first" and i == 0)


class TokenIdNames:
    """A tokenizer whose logprob entries name tokens `token_id:<id>` (`return_tokens_as_token_ids`);
    everything else is the tokenizer's own."""

    names_by_id = True

    def __init__(self, tok):
        self._tok = tok

    def __getattr__(self, name):
        return getattr(self._tok, name)


def logprob_names(prepared, tok):
    """The tokenizer the logprob entries of `prepared`'s answer are written with."""
    return TokenIdNames(tok) if getattr(prepared.request, "return_tokens_as_token_ids", False) else tok
