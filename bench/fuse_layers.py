"""The 30 SmolLM2-shaped layers' work outside attention, timed as the engine's plain code, `bench.fused`
eager, and torch.compile of `fused.pre` / `fused.post` (inductor, CPU C++), interleaved.

    python -m bench.fuse_layers [--weights full|int4] [--rows 1 4 16 256] [--modes plain fused compile]
        [--rounds 7] [--threads N]

Random weights (no model file), attention replaced by a fixed tensor. Prints each mode's first pass
(compilation included: run with a fresh TORCHINDUCTOR_CACHE_DIR for a cold compile), its max
difference from the plain code, whether a row's numbers change with the rows beside it, the dynamo
graph count, and the median and min ms per row count over the rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from bench import fused
from kvgate.config import ModelSpec
from kvgate.models.llama import LlamaModel
from kvgate.models.quant import probe_activation_dtype

SPEC = ModelSpec(
    "llama", 1024, 576, 1536, 30, 9, 3, 64, 100000.0, 1e-5, 2048, True
)  # SmolLM2-135M, small vocab


def weights(spec: ModelSpec) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    h, i, q, kv = spec.hidden_size, spec.intermediate_size, spec.q_size, spec.kv_size

    def r(*s):
        return torch.randn(*s, generator=g) * 0.05

    w = {"model.embed_tokens.weight": r(spec.vocab_size, h), "model.norm.weight": 1 + r(h)}
    for n in range(spec.num_layers):
        p = f"model.layers.{n}."
        w[p + "input_layernorm.weight"] = 1 + r(h)
        w[p + "post_attention_layernorm.weight"] = 1 + r(h)
        shapes = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h)}
        shapes |= {
            "self_attn.o_proj": (h, q),
            "mlp.gate_proj": (i, h),
            "mlp.up_proj": (i, h),
            "mlp.down_proj": (h, i),
        }
        w |= {p + k + ".weight": r(*s) for k, s in shapes.items()}
    return w


def plain_layer(x, attn, layer, cos, sin, spec):
    """The engine's layer code (kvgate.models.llama): rotate-half by slice/neg/cat, casts back."""
    ln1, qkv_proj, o_proj, ln2, gate_up_proj, down_proj = layer
    H, KVH, D, T = spec.num_heads, spec.num_kv_heads, spec.head_dim, x.shape[0]
    h = F.rms_norm(x, (x.shape[-1],), ln1, spec.rms_norm_eps)
    qkv = qkv_proj(h)
    qk = qkv[:, : (H + KVH) * D].view(T, H + KVH, D)
    rot = torch.cat((-qk[..., D // 2 :], qk[..., : D // 2]), dim=-1)
    qk = qk * cos + rot * sin
    x = x + o_proj(attn)
    h = F.rms_norm(x, (x.shape[-1],), ln2, spec.rms_norm_eps)
    gu = gate_up_proj(h)
    inter = gu.shape[-1] // 2
    return x + down_proj(F.silu(gu[:, :inter]) * gu[:, inter:])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", default="full")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 256])
    ap.add_argument("--modes", nargs="+", default=["plain", "fused", "compile"])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    from torch._dynamo.utils import counters

    act = probe_activation_dtype(a.weights) if a.weights != "full" else torch.bfloat16
    m = LlamaModel(SPEC, weights(SPEC), torch.float32, "cpu", weights_format=a.weights, act=act)
    m.set_row_buckets(max(a.rows), 16)
    s, eps = SPEC, SPEC.rms_norm_eps
    folded_sin = fused.sign_folded_sin(m.sin)
    mats = [tuple(fused.mat_args(lin) for lin in layer[1:3] + layer[4:]) for layer in m.layers]
    pieces = {"fused": (fused.pre, fused.post)}
    if "compile" in a.modes:
        pieces["compile"] = (torch.compile(fused.pre, dynamic=True), torch.compile(fused.post, dynamic=True))

    def run(mode, x, attn, pos):
        cos = m.cos[pos].unsqueeze(1)
        if mode == "plain":
            sin = m.sin[pos].unsqueeze(1)
            for layer in m.layers:
                x = plain_layer(x, attn, layer, cos, sin, s)
            return x
        pre, post = pieces[mode]
        sin = folded_sin[pos].unsqueeze(1)
        for (ln1, _, _, ln2, _, _), (qkv, o, gu, down) in zip(m.layers, mats):
            pre(x, ln1, qkv, cos, sin, eps, s.num_heads, s.num_kv_heads)
            x = post(x, attn, o, ln2, gu, down, eps)
        return x

    def inputs(T):
        g = torch.Generator().manual_seed(T)
        return (
            torch.randn(T, s.hidden_size, generator=g),
            torch.randn(T, s.q_size, generator=g),
            torch.arange(T) + 300,
        )

    with torch.inference_mode():
        for mode in a.modes:
            t0 = time.perf_counter()
            for T in a.rows:
                x, attn, pos = inputs(T)
                run(mode, x, attn, pos)
            print(
                f"{mode}: first pass {time.perf_counter() - t0:.1f} s, dynamo {dict(counters['stats'])}",
                flush=True,
            )
        x, attn, pos = inputs(16)
        ref16 = run("plain", x.clone(), attn, pos)
        for mode in a.modes:
            all16 = run(mode, x.clone(), attn, pos)
            alone = max(
                (run(mode, x[:n].clone(), attn[:n], pos[:n]) - all16[:n]).abs().max().item()
                for n in (1, 2, 3, 7)
            )
            print(
                f"{mode}: max |diff| from plain {(all16 - ref16).abs().max().item():.3g}, row-count dependence {alone:.3g}"
            )
        ts = {(mode, T): [] for mode in a.modes for T in a.rows}
        for _ in range(a.rounds):
            for T in a.rows:
                x, attn, pos = inputs(T)
                for mode in a.modes:
                    t0 = time.perf_counter()
                    run(mode, x.clone(), attn, pos)
                    ts[mode, T].append((time.perf_counter() - t0) * 1000)
    print(f"\nweights {a.weights}, torch threads {torch.get_num_threads()}, ms for 30 layers (median / min)")
    print("| mode | " + " | ".join(f"{T} rows" for T in a.rows) + " |")
    print("|---" * (len(a.rows) + 1) + "|")
    for mode in a.modes:
        cells = [f"{statistics.median(ts[mode, T]):.1f} / {min(ts[mode, T]):.1f}" for T in a.rows]
        print(f"| {mode} | " + " | ".join(cells) + " |")
    print(f"dynamo after the timed rounds: {dict(counters['stats'])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
