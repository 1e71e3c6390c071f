"""The prompts a benchmark sends: synthetic ones of an exact token length, or a JSONL dataset.

`build_prompts` draws distinct prompts from a fixed word list (seeded: the same seed and tokenizer
give the same prompts) and fits each to `input_len` tokens as the server's own tokenizer counts them; when the
server cannot count, it sizes them by a characters-per-token estimate and leaves the count unknown.
`load_dataset` reads one JSON object per line: `prompt` (or `text`) or `messages`, optionally
`output_len` (or `max_tokens`), `prompt_tokens`, `prompt_ids`.
"""

from __future__ import annotations

import json
import random
import sys
import time

from kvgate.bench.client import Target
from kvgate.bench.records import Prompt

# A fixed word list: prompts are random draws from it, so every prompt is distinct from its first word.
WORDS = """
time year people way day man thing woman life child world school state family student group country
problem hand part place case week company system program question work government number night point
home water room mother area money story fact month lot right study book eye job word business issue
side kind head house service friend father power hour game line end member law car city community name
president team minute idea kid body information back parent face others level office door health person
art war history party result change morning reason research girl guy moment air teacher force education
foot boy age policy process music market sense nation plan college interest death experience effect use
class control care field development role effort rate heart drug show leader light voice wife police
mind price report decision son view relationship town road arm difference value building action model
season society tax director position player record paper space ground form event official matter center
couple site project activity star table need court oil situation cost industry figure street image phone
data picture practice piece land product doctor wall patient worker news test movie north love support
technology step baby computer type attention film tree source organization hair window evidence
population truth song river garden ocean mountain bridge engine signal memory pattern winter summer
""".split()


async def build_prompts(
    target: Target, n: int, input_len: int, seed: int, progress: bool = True
) -> list[Prompt]:
    """`n` distinct prompts of `input_len` tokens each (as the server counts them, when it can)."""
    rng = random.Random(seed)
    exact = await target.count_tokens("hello world") is not None
    out: list[Prompt] = []
    ratio = 1.3  # tokens per word, refined as we go
    t_last = 0.0
    for i in range(n):
        words = [rng.choice(WORDS) for _ in range(max(1, int(input_len / ratio)) + 8)]
        words[0] = words[0].capitalize()
        if not exact:
            k = max(1, round(input_len * 4 / 5.5))  # ~4 chars per token, ~5.5 chars per word with the space
            words += [rng.choice(WORDS) for _ in range(k - len(words))]
            out.append(Prompt(text=" ".join(words[:k]), prompt_tokens=None))
            continue
        text, tokens = await _fit_words(target, words, input_len, ratio, rng)
        ratio = 0.8 * ratio + 0.2 * (tokens / max(1, len(text.split())))
        out.append(Prompt(text=text, prompt_tokens=tokens))
        if progress and time.monotonic() - t_last > 1:
            t_last = time.monotonic()
            print(f"\rbuilding prompts {i + 1}/{n}", end="", file=sys.stderr, flush=True)
    if progress and exact and n:
        print(f"\rbuilt {n} prompts of {input_len} tokens (counted by the server)", file=sys.stderr)
    return out


async def _fit_words(
    target: Target, words: list[str], want: int, ratio: float, rng: random.Random
) -> tuple[str, int]:
    """The prefix of `words` whose token count is closest to `want` (ties: the shorter), then topped up
    one character at a time for tokenizers where a word is several tokens."""
    seen: dict[int, int] = {}

    async def count(k: int) -> int:
        while k > len(words):
            words.append(rng.choice(WORDS))
        if k not in seen:
            seen[k] = await target.count_tokens(" ".join(words[:k]))
        return seen[k]

    k = max(1, round(want / ratio))
    for _ in range(12):
        c = await count(k)
        if c == want:
            break
        nk = max(1, round(want * k / max(c, 1)))
        if nk in seen:
            nk = k + (1 if c < want else -1)
        if nk < 1 or nk in seen:
            break
        k = nk
    under = [k for k, c in seen.items() if c <= want]
    k = max(under, key=lambda k: seen[k]) if under else min(seen, key=lambda k: seen[k])
    text, c = " ".join(words[:k]), seen[k]
    fill = "etaoinshrdlu"
    for i in range(2 * (want - c) + 4):
        if c >= want:
            break
        cand = text + fill[i % len(fill)]
        cc = await target.count_tokens(cand)
        if cc > want:
            break
        text, c = cand, cc
    return text, c


def load_dataset(path: str) -> list[Prompt]:
    """JSONL: one object per line with `prompt` (or `text`) or `messages`; optional `output_len`
    (or `max_tokens`), `prompt_tokens`, `prompt_ids`."""
    out = []
    with open(path) as f:
        for i, line in enumerate(f):
            line = line.strip()
            if not line:
                continue
            obj = json.loads(line)
            text = obj.get("prompt", obj.get("text"))
            if text is None and "messages" not in obj:
                raise ValueError(f"{path}:{i + 1}: each line needs 'prompt', 'text' or 'messages'")
            out.append(
                Prompt(
                    text=text,
                    messages=obj.get("messages"),
                    prompt_tokens=obj.get("prompt_tokens"),
                    output_len=obj.get("output_len", obj.get("max_tokens")),
                    prompt_ids=obj.get("prompt_ids"),
                )
            )
    if not out:
        raise ValueError(f"{path} holds no prompts")
    return out
