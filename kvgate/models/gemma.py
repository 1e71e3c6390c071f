"""Gemma 3 forward over the paged KV cache: the Llama layer with Gemma's differences, nothing else.

Gemma 3 (`Gemma3ForCausalLM`; llama.cpp's `gemma3`) differs from the Llama layer in `kvgate.models.llama`:
- the token embeddings are scaled by sqrt(hidden_size) (in the model dtype, as transformers does);
- four norms a layer ("sandwich"): the attention's and the MLP's outputs are RMS-normed before they join
  the residual stream, beside the usual norms before each; q and k heads are RMS-normed (as Qwen3);
- RMSNorm multiplies by (1 + w): an HF checkpoint stores w, a GGUF 1 + w (`ModelSpec.norm_offset`);
- the MLP is GELU (tanh approximation) of gate, times up;
- five layers in six attend over only the last `sliding_window` positions (512 in 270M and 1B), with
  RoPE base 10,000 and no scaling; the others over the whole context with the model's base (1e6) and
  scaling;
- scores are scaled by 1/sqrt(query_pre_attn_scalar) (= head_dim but in 27B): q is multiplied by the
  ratio to 1/sqrt(head_dim), so every attention path keeps its own scale.

The forward is `LlamaModel`'s PyTorch-op path (`glue_in`, `attend`, `glue_out`), which these methods
override; so CUDA graphs and the step pieces run Gemma too. kvgate's C++ layer ops and the C++ decode
stack are Llama's layer and stay off. A sliding layer takes the model's attention kernels while the
step's every position is inside the window (then the window masks nothing); past it, that layer's
attention is gather + SDPA with the window in the mask. Both K/V of sliding layers are kept for the
whole context, as for any layer: the plan charges that, which is more than the window needs.
"""

from __future__ import annotations

from collections.abc import MutableMapping

import torch
import torch.nn.functional as F

from kvgate.models import rope
from kvgate.models.llama import LlamaModel, StepBatch
from kvgate.models.paged_attention import gather_attention, window_mask
from kvgate.models.prefill_attention import sdpa

NORMS = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
)


class GemmaModel(LlamaModel):
    def __init__(self, spec, weights, dtype, device, **kw):
        prefix = [f"model.layers.{i}." for i in range(spec.num_layers)]
        shifted = {}
        if spec.norm_offset:  # an HF checkpoint's w of (1 + w): added once, in float32
            names = [p + n + ".weight" for p in prefix for n in NORMS] + ["model.norm.weight"]
            names += [p + f"self_attn.{n}_norm.weight" for p in prefix for n in "qk"]
            shifted = {n: weights.pop(n).to(torch.float32) + spec.norm_offset for n in names}
        weights = _Renamed(weights, shifted)

        def take(name: str) -> torch.Tensor:
            return weights.pop(name).to(device=device, dtype=dtype)

        # Gemma's two output norms are its own; Llama's slot for the norm before the MLP (its
        # post_attention_layernorm) reads Gemma's pre-feedforward norm
        self.out_norms = [
            (take(p + "post_attention_layernorm.weight"), take(p + "post_feedforward_layernorm.weight"))
            for p in prefix
        ]
        weights.renames = {
            p + "post_attention_layernorm.weight": p + "pre_feedforward_layernorm.weight" for p in prefix
        }
        super().__init__(spec, weights, dtype, device, **kw)
        self.layer_ops = self.decode_stack = None  # Llama's C++ layer: see the module doc
        self.windows = [spec.sliding_window if i in spec.window_layers else 0 for i in range(spec.num_layers)]
        # the sliding layers' RoPE beside the full layers' in one table, [positions, 2 * head_dim]: every
        # caller's `cos[positions]` gathers both, and `glue_in` takes the layer's half
        cos, sin = rope.tables(spec.rope_local_theta, spec.head_dim, self.cos.shape[0], {})
        self.cos = torch.cat((self.cos, cos.to(self.cos)), dim=-1)
        self.sin = torch.cat((self.sin, sin.to(self.sin)), dim=-1)
        self.embed_scale = torch.tensor(spec.hidden_size**0.5, dtype=dtype).item()
        qs = spec.query_scale or spec.head_dim
        self.q_factor = (spec.head_dim / qs) ** 0.5 if qs != spec.head_dim else None

    @property
    def weight_bytes(self) -> int:
        return super().weight_bytes + sum(
            t.numel() * t.element_size() for pair in self.out_norms for t in pair
        )

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return super().embed_tokens(ids) * self.embed_scale

    def glue_in(self, li: int, x, pending, cos, sin, slots, kv, n_dec: int):
        D = self.spec.head_dim
        half = slice(D, 2 * D) if self.windows[li] else slice(0, D)
        x, q = super().glue_in(li, x, pending, cos[..., half], sin[..., half], slots, kv, n_dec)
        return x, (q if self.q_factor is None else q * self.q_factor)

    def glue_out(self, li: int, x, attn, n_dec: int):
        s = self.spec
        _, _, o_proj, ln2, gate_up_proj, down_proj = self.layers[li]
        after_attn, after_mlp = self.out_norms[li]
        x = x + F.rms_norm(o_proj(attn, n_dec), (s.hidden_size,), after_attn, s.rms_norm_eps)
        h = F.rms_norm(x, (s.hidden_size,), ln2, s.rms_norm_eps)
        gu = gate_up_proj(h, n_dec)
        inter = gu.shape[-1] // 2
        down = down_proj(F.gelu(gu[:, :inter], approximate="tanh") * gu[:, inter:], n_dec)
        return x, F.rms_norm(down, (s.hidden_size,), after_mlp, s.rms_norm_eps)

    def attend(self, li: int, q, batch: StepBatch, kv, n_dec: int, out=None):
        W = self.windows[li]
        if not W or (self.device.type == "cpu" and int(batch.positions.max()) < W):
            return super().attend(li, q, batch, kv, n_dec, out)
        H, D = self.spec.num_heads, self.spec.head_dim
        T = batch.input_ids.shape[0]
        k_pool, v_pool = kv.k[li], kv.v[li]
        scales = kv.scales(li)
        attn = out if out is not None else torch.empty((T, H * D), dtype=q.dtype, device=q.device)
        for grp in batch.decode_groups:
            mask = window_mask(grp.lens, grp.width, W)
            og = gather_attention(q[grp.start : grp.end], k_pool, v_pool, grp.block_tables, mask, *scales)
            attn[grp.start : grp.end] = og.reshape(grp.end - grp.start, H * D)
        for pf in batch.prefills:
            attn[pf.start : pf.start + pf.q_len] = sdpa(q, k_pool, v_pool, pf, *scales, window=W)
        return attn


class _Renamed(MutableMapping):
    """The checkpoint as `LlamaModel` reads it: a name in `renames` is read under the name it maps to,
    from `shifted` (norms with their offset added) before the checkpoint."""

    def __init__(self, base, shifted: dict):
        self.base, self.shifted, self.renames = base, shifted, {}

    def _source(self, name: str):
        name = self.renames.get(name, name)
        return (self.shifted if name in self.shifted else self.base), name

    def __getitem__(self, name: str) -> torch.Tensor:
        where, name = self._source(name)
        return where[name]

    def __setitem__(self, name: str, value) -> None:
        self.shifted[name] = value

    def __delitem__(self, name: str) -> None:
        where, name = self._source(name)
        del where[name]

    def __contains__(self, name) -> bool:
        where, name = self._source(name)
        return name in where

    def __iter__(self):
        back = {v: k for k, v in self.renames.items()}
        yield from (back.get(n, n) for n in [*self.shifted, *self.base])

    def __len__(self) -> int:
        return len(self.shifted) + len(self.base)
