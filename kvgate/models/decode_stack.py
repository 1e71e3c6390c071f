"""The layer stack of a decode-only step in one C++ call (kvgate/models/csrc/decode_stack.cpp).

`build(model)` returns a `DecodeStack` for a model whose forward would call only kvgate's C++ kernels
between the embedding and the final norm: CPU, float32, the C++ layer ops, the paged decode kernel,
and every layer matmul a `Q41Linear` (`--weights gguf`), a `BlockLinear` (gguf's other block formats) or
a `Q41Dot8Linear` (`gguf-q8act`) without a bias. A Qwen3's q and k head norms go in with `set_qk_norms`
and run after each qkv matmul, by the row function the loop's `qk_norm_` calls.
Any other model gets None and keeps the Python loop.

The forward uses the stack for steps whose tokens are all decode rows (a verify span's positions
are decode rows too; a prompt chunk is not). It runs the same kernels in the same order as the loop (SiLU * up included: both call silu_mul), so
the logits are bit for bit the loop's (tests/test_decode_stack.py). What it saves is the loop's cost
between kernels: at one row ~12 Python-level calls and tensor ops a layer, 30 layers. It releases
the GIL while it runs. It runs every layer in one OpenMP parallel region (its thread team: no fork,
join or idle thread per op; a one-row stack on Zen 4: gguf 3.73 -> 2.93 ms, gguf-q8act 3.09 -> 2.30);
KVGATE_DECODE_TEAM=0 keeps it op by op.
"""

from __future__ import annotations

import os

from kvgate.models import native
from kvgate.models.block_formats import BlockLinear
from kvgate.models.q4_1 import Q41Linear
from kvgate.models.q4_1_dot8 import Q41Dot8Linear

# KVGATE_DECODE_STACK=0 keeps the Python loop for every step (to compare the two; nothing else changes)
ENV = "KVGATE_DECODE_STACK"
# KVGATE_DECODE_TEAM=0 runs the stack one op after another instead of on its thread team (the same bits)
TEAM_ENV = "KVGATE_DECODE_TEAM"


def _parts(lin) -> tuple[object, int, str] | None:
    """A matrix as the C++ stack takes it: (its tiles, out_features, kind)."""
    if getattr(lin, "bias", None) is not None:
        return None
    if isinstance(lin, Q41Dot8Linear):
        return lin.packed, lin.out_features, "q4_1_dot8"
    if isinstance(lin, Q41Linear):
        return lin.packed, lin.out_features, "q4_1"
    if isinstance(lin, BlockLinear):
        return lin.packed, lin.out_features, "block"
    return None


def build(model):
    """The model's `DecodeStack`, or None where the forward must keep its loop (see the module doc)."""
    if os.environ.get(ENV, "1") == "0" or model.layer_ops is None or not model.paged_attention:
        return None
    ext = native.extension()
    if ext is None:
        return None
    norms, mats, outs, kinds = [], [], [], []
    for ln1, qkv, o, ln2, gate_up, down in model.layers:
        norms += [ln1, ln2]
        for lin in (qkv, o, gate_up, down):
            found = _parts(lin)
            if found is None:
                return None
            mats.append(found[0])
            outs.append(found[1])
            kinds.append(found[2])
    s = model.spec
    stack = ext.DecodeStack(norms, mats, outs, kinds, s.num_heads, s.num_kv_heads, s.head_dim, s.rms_norm_eps)
    if model.qk_norms is not None:  # Qwen3
        stack.set_qk_norms([t for pair in model.qk_norms for t in pair])
    stack.set_team(os.environ.get(TEAM_ENV, "1") != "0")
    return stack
