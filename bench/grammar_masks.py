"""Grammar engines side by side: token-mask time per token, batched, at SmolLM2's 49,152-token vocabulary.

Why it exists: issue 13 chose the grammar engine by measurement on this CPU. Each engine builds its
tokenizer from kvgate's own `tokenizer.json` (the default model's), compiles the same JSON schemas,
and then, for batches of B rows (each row its own matcher, following its own valid document token by
token, as real rows would), times one batched mask fill per step and the token commits. Reported per
row-token: the mask fill (the engine's batched call, all threads), the commit, and the cost of applying
the packed bitmask to float32 logits in torch (the same for both engines; kvgate's
`kvgate.structured.masks.apply_bitmask`).

    PYTHONPATH=/path/with/both/engines .venv/bin/python -m bench.grammar_masks [--batches 1,8,32]

An engine that is not installed is skipped (kvgate installs only the one it uses).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string"},
        "status": {"enum": ["active", "inactive", "banned"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "score": {"type": "number"},
    },
    "required": ["name", "age", "email", "status", "tags", "address", "score"],
    "additionalProperties": False,
}
WORDS = "alpha beta gamma delta river stone cloud maple north quiet amber tiger".split()


def documents(n: int, kind: str) -> list[str]:
    rnd = random.Random(7)
    out = []
    for i in range(n):
        doc = {
            "name": f"{rnd.choice(WORDS).title()} {rnd.choice(WORDS).title()}",
            "age": rnd.randint(1, 99),
            "email": f"{rnd.choice(WORDS)}{i}@example.com",
            "status": rnd.choice(["active", "inactive", "banned"]),
            "tags": [rnd.choice(WORDS) for _ in range(rnd.randint(1, 4))],
            "address": {"city": rnd.choice(WORDS).title(), "zip": str(rnd.randint(10000, 99999))},
            "score": round(rnd.random() * 100, 2),
        }
        if kind == "json_object":  # free JSON: a different shape, nested lists and nulls
            doc = {"items": [doc["tags"], {"k": None, "n": doc["age"]}], "note": doc["name"]}
        out.append(json.dumps(doc))
    return out


def default_tokenizer():
    from kvgate.models import load_model  # converts the GGUF once into ~/.cache/kvgate

    return load_model("default").tokenizer


class LLG:
    name = "llguidance"

    def __init__(self, info, threads: int):
        import llguidance
        import llguidance.torch

        self.llg, self.lt = llguidance, llguidance.torch
        t0 = time.perf_counter()
        self.tok = llguidance.LLTokenizer(info.tokenizer_json, eos_token=info.eog_token_ids[-1])
        self.tokenizer_s = time.perf_counter() - t0
        self.ex = llguidance.LLExecutor(num_threads=threads)
        self.vocab = self.tok.vocab_size

    def compile(self, kind: str):
        schema = SCHEMA if kind == "json_schema" else {"type": "object"}
        return self.llg.LLMatcher.grammar_from_json_schema(schema)

    def matchers(self, grammar, n: int):
        ms = [self.llg.LLMatcher(self.tok, grammar) for _ in range(n)]
        assert not ms[0].is_error(), ms[0].get_error()
        return ms

    def fill(self, ms, bitmask) -> None:
        self.lt.fill_next_token_bitmask_par(self.ex, [(m, i) for i, m in enumerate(ms)], bitmask)

    def commit(self, ms, tokens) -> None:
        for m, t in zip(ms, tokens, strict=True):
            assert m.consume_token(t), m.get_error()


class XGR:
    name = "xgrammar"

    def __init__(self, info, threads: int):
        import transformers
        import xgrammar

        from kvgate.tokenizer import TextTokenizer

        self.xgr = xgrammar
        t0 = time.perf_counter()
        hf = transformers.PreTrainedTokenizerFast(tokenizer_object=TextTokenizer(info).tok)
        self.vocab = hf.backend_tokenizer.get_vocab_size(with_added_tokens=True)
        ti = xgrammar.TokenizerInfo.from_huggingface(
            hf, vocab_size=self.vocab, stop_token_ids=list(info.eog_token_ids)
        )
        # no compile cache: every run pays a real compile (kvgate keeps its own cache by schema)
        self.compiler = xgrammar.GrammarCompiler(ti, max_threads=threads, cache_enabled=False)
        self.tokenizer_s = time.perf_counter() - t0
        self.batch = xgrammar.BatchGrammarMatcher(max_threads=threads)

    def compile(self, kind: str):
        if kind == "json_schema":
            return self.compiler.compile_json_schema(json.dumps(SCHEMA))
        return self.compiler.compile_builtin_json_grammar()

    def matchers(self, grammar, n: int):
        return [self.xgr.GrammarMatcher(grammar) for _ in range(n)]

    def fill(self, ms, bitmask) -> None:
        self.batch.batch_fill_next_token_bitmask(ms, bitmask)

    def commit(self, ms, tokens) -> None:
        for m, t in zip(ms, tokens, strict=True):
            assert m.accept_token(t)


def run(engine, tok, kind: str, batch: int) -> dict:
    words = (engine.vocab + 31) // 32
    bitmask = torch.full((batch, words), -1, dtype=torch.int32)
    # compile: from the schema to the first mask of one fresh matcher (llguidance builds lazily)
    t0 = time.perf_counter()
    first = engine.matchers(engine.compile(kind), 1)
    engine.fill(first, bitmask)
    compile_s = time.perf_counter() - t0
    grammar = engine.compile(kind)
    docs = [tok.encode(d, add_bos=False) for d in documents(batch, kind)]
    ms = engine.matchers(grammar, batch)
    logits = torch.randn(batch, engine.vocab)
    fills, commits, applies = [], [], []
    from kvgate.structured.masks import apply_bitmask

    steps = max(len(d) for d in docs)
    for s in range(steps):
        live = [i for i, d in enumerate(docs) if s < len(d)]
        sub = [ms[i] for i in live]
        t = time.perf_counter()
        engine.fill(sub, bitmask)
        fills.append((time.perf_counter() - t) / len(live))
        t = time.perf_counter()
        engine.commit(sub, [docs[i][s] for i in live])
        commits.append((time.perf_counter() - t) / len(live))
        x = logits[: len(live)].clone()
        t = time.perf_counter()
        apply_bitmask(x, bitmask[: len(live)])
        applies.append((time.perf_counter() - t) / len(live))
    us = 1e6
    return {
        "engine": engine.name,
        "kind": kind,
        "batch": batch,
        "tokens_per_row": round(statistics.mean(len(d) for d in docs), 1),
        "compile_to_first_mask_ms": round(compile_s * 1e3, 1),
        "mask_us_per_token_median": round(statistics.median(fills) * us, 1),
        "mask_us_per_token_p99": round(sorted(fills)[int(0.99 * (len(fills) - 1))] * us, 1),
        "mask_us_per_token_max": round(max(fills) * us, 1),
        "commit_us_per_token": round(statistics.median(commits) * us, 1),
        "apply_us_per_token": round(statistics.median(applies) * us, 1),
    }


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.grammar_masks", description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true", help="one JSON object per line instead of a table")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    info = default_tokenizer()
    from kvgate.tokenizer import TextTokenizer

    tok = TextTokenizer(info)
    print(f"# CPU: {cpu_model()}, {a.threads} threads; vocab {tok.vocab_size}")
    engines = []
    for cls in (LLG, XGR):
        try:
            engines.append(cls(info, a.threads))
        except ImportError as exc:
            print(f"# {cls.name}: not installed ({exc})")
    for e in engines:
        print(f"# {e.name}: tokenizer setup {e.tokenizer_s * 1e3:.0f} ms")
    rows = []
    for kind in ("json_schema", "json_object"):
        for b in (int(x) for x in a.batches.split(",")):
            for e in engines:
                rows.append(run(e, tok, kind, b))
                if a.json:
                    print(json.dumps(rows[-1]))
    if not a.json:
        keys = list(rows[0])
        print("| " + " | ".join(keys) + " |")
        print("|" + "---|" * len(keys))
        for r in rows:
            print("| " + " | ".join(str(r[k]) for k in keys) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
