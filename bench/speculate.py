"""Prompt-lookup speculative decoding (`--speculate K`): acceptance and speedup, one stream.

    python -m bench.speculate [--k 0 2 4 8] [--max-tokens 160] [--weights full] [--temperature 0]
        [--workload free] [--adapt on off] [--prediction] [--rounds 3]

Runs the real engine (no server) on SmolLM2 with its chat template, one request at a time, for two
workloads: input-grounded (rewrite or correct a given paragraph: the answer repeats much of the
prompt, so n-gram drafts are often right) and free generation (a story: drafts come only from the
model's own repetitions). For each K it reports decode tok/s, the speedup against K=0 measured in the
same run, the draft acceptance rate, and whether every request's tokens equal the K=0 tokens (they
must: speculation verifies drafts against the model's own greedy choice). With `--temperature T > 0`
the requests sample (seeded, top-p 0.95) and drafts pass the rejection rule: the tokens differ from
K=0 by design (same distribution, other draws), so that column reads "sampled". With `--prediction`,
each K > 0 also runs the input-grounded requests with the paragraph as OpenAI's `prediction`
(`kvgate.core.predicted`: drafts from it first, then from the n-gram index), as an editor would send
the file it asks to change. Prints a markdown table with the CPU model and flags.
"""

from __future__ import annotations

import argparse

PARAGRAPH = (
    "The river town of Aldermoor sits where two valleys meet. Every spring the snow on the northern "
    "ridge melts and the river rises, and the townspeople move their boats to the upper docks. The "
    "market opens at dawn on Saturdays, and farmers bring apples, cheese, wool and honey from the "
    "hills. The old stone bridge was built three hundred years ago and has survived every flood. "
    "Children learn to swim in the shallow bend below the mill, and in the evenings the bell of the "
    "chapel rings seven times."
)
WORKLOADS = {
    "input-grounded": [
        f"Repeat the following paragraph exactly, word for word:\n\n{PARAGRAPH}",
        f"Rewrite this paragraph in the past tense, changing nothing else:\n\n{PARAGRAPH}",
        f"Fix the spelling in this text and return the whole text:\n\n{PARAGRAPH.replace('the', 'teh', 4)}",
    ],
    "free generation": [
        "Write a short story about a lighthouse keeper who finds a message in a bottle.",
        "Explain how a bicycle works to a ten-year-old.",
        "List ten ideas for a weekend in the mountains, with one sentence each.",
    ],
}


def run(
    k: int,
    prompts: list[str],
    max_tokens: int,
    weights: str,
    temperature: float = 0.0,
    adapt: bool = True,
    prediction: str | None = None,
) -> dict:
    from kvgate.config import EngineConfig
    from kvgate.core import speculate
    from kvgate.core.engine import Engine
    from kvgate.request import GenerationRequest
    from kvgate.sampling import SamplingParams

    e = Engine.from_model(
        "default",
        EngineConfig(speculate=k, weights=weights, memory_limit="3GiB", max_model_len=2048, max_seqs=4),
    )
    keep_min = speculate.KEEP_MIN
    speculate.KEEP_MIN = keep_min if adapt else 0.0  # a rate never below 0: the gate never pauses
    try:
        e.start()
        tokens, seconds, produced, predicted = [], 0.0, 0, 0
        pred = None if prediction is None else e.tokenizer.encode(prediction, add_bos=False)
        for p in prompts:
            ids = e.tokenizer.encode(e.tokenizer.render_chat([{"role": "user", "content": p}]))
            sp = SamplingParams(temperature=temperature, top_p=0.95 if temperature else 1.0, seed=11)
            req = GenerationRequest(ids, sp, max_tokens, prediction_ids=pred)
            r = e.generate(req, timeout=900)
            tokens.append(r.token_ids)
            predicted += r.prediction_tokens[0] if r.prediction_tokens else 0
            if r.first_token_at is not None and len(r.token_ids) > 1:
                seconds += r.finished_at - r.first_token_at  # decode time, after the prompt
                produced += len(r.token_ids) - 1
        c = e.core.state.counters
        return {
            "tokens": tokens,
            "tok_s": produced / seconds if seconds else 0.0,
            "drafted": c.spec_draft_tokens,
            "accepted": c.spec_accepted_tokens,
            "from_prediction": predicted,
            "generated": c.generated_tokens,
        }
    finally:
        e.shutdown()
        speculate.KEEP_MIN = keep_min


def main(argv: list[str] | None = None) -> int:
    import torch

    from bench.cpu import cpu_line, machine_info

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, nargs="+", default=[0, 4])
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--weights", default="full")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; > 0 samples (top-p 0.95)")
    ap.add_argument("--workload", choices=["input", "free"], nargs="+", default=["input", "free"])
    ap.add_argument("--adapt", choices=["on", "off"], nargs="+", default=["on"], help="the draft gate")
    ap.add_argument("--rounds", type=int, default=1, help="repeat everything, interleaved")
    ap.add_argument("--prediction", action="store_true", help="also send the paragraph as the prediction")
    a = ap.parse_args(argv)
    ks = sorted(set([0, *a.k]))
    variants = [(0, True, False)] + [(k, ad == "on", False) for k in ks if k for ad in a.adapt]
    if a.prediction:
        variants += [(k, ad == "on", True) for k in ks if k for ad in a.adapt]
    print(
        f"{cpu_line(machine_info())} torch threads {torch.get_num_threads()}; weights {a.weights}; "
        f"{'greedy' if not a.temperature else f'temperature {a.temperature:g}, top-p 0.95'}, one stream"
    )
    print()
    print(
        "| workload | round | K | gate | prediction | decode tok/s | speedup vs K=0 | drafts accepted "
        "| of them from the prediction | tokens per step | same tokens as K=0 |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for rnd in range(1, a.rounds + 1):
        for name, prompts in WORKLOADS.items():
            if name.split()[0].split("-")[0] not in a.workload:
                continue
            base = None
            for k, adapt, predict in variants:
                if predict and name != "input-grounded":
                    continue
                text = PARAGRAPH if predict else None
                r = run(k, prompts, a.max_tokens, a.weights, a.temperature, adapt, text)
                base = base or r
                rate = r["accepted"] / r["drafted"] if r["drafted"] else 0.0
                steps = r["generated"] - r["accepted"]  # one step per token the model chose itself
                per_step = r["generated"] / steps if steps else 1.0
                same = "sampled" if a.temperature else "yes" if r["tokens"] == base["tokens"] else "NO"
                print(
                    f"| {name} | {rnd} | {k} | {'on' if adapt and k else 'off' if k else '-'} | "
                    f"{'yes' if predict else '-'} | {r['tok_s']:.1f} | x{r['tok_s'] / base['tok_s']:.2f} | "
                    f"{r['accepted']}/{r['drafted']} ({rate:.0%}) | {r['from_prediction'] if predict else '-'} | "
                    f"{per_step:.2f} | {same} |",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
