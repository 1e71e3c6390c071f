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

The forward is `LlamaModel`'s PyTorch-op path (`glue_in`, `attend`, `glue_out`), whose glue these methods
override, with kvgate's C++ RMSNorm, q/k norm and RoPE + K/V write in float32 on CPU; so CUDA graphs and
the step pieces run Gemma too. The C++ decode stack is Llama's layer and stays off. A sliding layer's
window is an argument of every attention path (`LlamaModel.attend`): the paged decode and prefill kernels
start each row or query at its window, so a row's numbers stay its own whatever runs beside it; the gather
and SDPA paths mask it. K/V of sliding layers are kept for the whole context, as for any layer: the plan
charges that, which is more than the window needs.
"""

from __future__ import annotations

from collections.abc import MutableMapping

import torch
import torch.nn.functional as F

from kvgate.models import rope
from kvgate.models.llama import LlamaModel

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
        # the forward's C++ path and decode stack are Llama's layer; Gemma's glue calls the ops itself
        self.ops, self.layer_ops, self.decode_stack = self.layer_ops, None, None
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
        s, ops = self.spec, self.ops
        H, KVH, D = s.num_heads, s.num_kv_heads, s.head_dim
        half = slice(D, 2 * D) if self.windows[li] else slice(0, D)
        if ops is None:
            x, q = super().glue_in(li, x, pending, cos[..., half], sin[..., half], slots, kv, n_dec)
        else:  # float32 on CPU: kvgate's C++ RMSNorm (+ the residual add), q/k norms, RoPE + K/V write
            ln1, qkv_proj = self.layers[li][:2]
            eps = s.rms_norm_eps
            h = ops.rms_norm(x, ln1, eps) if pending is None else ops.add_rms_norm_(x, pending, ln1, eps)
            qkv = self.qk_norm(li, qkv_proj(h, n_dec))
            c, n = cos[:, 0, half].contiguous(), sin[:, 0, half].contiguous()
            ops.rope_write_kv_(qkv, H, KVH, c, n, slots, kv.k[li], kv.v[li], *kv.scales(li))
            q = qkv[:, : H * D].view(-1, H, D)
        return x, (q if self.q_factor is None else q * self.q_factor)

    def qk_norm(self, li: int, qkv: torch.Tensor) -> torch.Tensor:
        if self.ops is None:
            return super().qk_norm(li, qkv)
        s = self.spec
        self.ops.qk_norm_(qkv, s.num_heads, s.num_kv_heads, *self.qk_norms[li], s.rms_norm_eps)
        return qkv

    def glue_out(self, li: int, x, attn, n_dec: int):
        s, ops = self.spec, self.ops
        _, _, o_proj, ln2, gate_up_proj, down_proj = self.layers[li]
        after_attn, after_mlp = self.out_norms[li]
        eps = s.rms_norm_eps

        def norm(t, w):
            return F.rms_norm(t, (s.hidden_size,), w, eps) if ops is None else ops.rms_norm(t, w, eps)

        if ops is None:
            x = x + norm(o_proj(attn, n_dec), after_attn)
            h = norm(x, ln2)
        else:  # x += the normed attention output, in place, then the norm before the MLP
            h = ops.add_rms_norm_(x, norm(o_proj(attn, n_dec), after_attn), ln2, eps)
        gu = gate_up_proj(h, n_dec)
        inter = gu.shape[-1] // 2
        down = down_proj(F.gelu(gu[:, :inter], approximate="tanh") * gu[:, inter:], n_dec)
        return x, norm(down, after_mlp)


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
