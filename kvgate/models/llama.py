"""Llama-family forward over the paged KV cache (Llama, SmolLM, Mistral, Qwen2, Qwen3).

One call runs one engine step: any number of decode rows (one token each) plus prefill chunks, all
concatenated into one flat token list so every linear layer is one matmul for the whole step. The
layer is deliberately short: RMSNorm -> fused QKV matmul (-> RMSNorm of each q and k head: Qwen3) ->
RoPE on q and k together -> write K/V into the pool -> attention over the row's blocks -> output
projection -> RMSNorm -> fused gate/up matmul -> SiLU * up -> down projection. Logits are computed only for the tokens the sampler needs.

Attention uses grouped queries without repeating K/V in the step's own code: a decode row's queries are
viewed as `[kv_heads, group, head_dim]`; a prefill chunk goes to SDPA as q `[1, heads, q_len, D]` and
K/V `[1, kv_heads, context, D]` with `enable_gqa`, `is_causal` for a prompt's first chunk and a
`[q_len, context]` mask after a cached prefix or an earlier chunk. On CPU that is twice as fast as the
`[kv_heads, group * q_len, D]` view with a group-repeated mask it replaced (SmolLM2, 256-token prompt:
3.2 -> 1.3-1.8 ms a layer; `is_causal` and the mask give the same bits).

Decode rows take one of two paths, chosen at startup (`kvgate.models.paged_attention.resolve`): the
paged CPU kernel runs every decode row of the step in one call per layer, reading K/V from the pool
in place; the gather path copies each group's blocks (`index_select`) and runs SDPA with a mask
(CUDA, or where the kernel cannot be built or measures slower). Prefill chunks take the paged CPU
prefill kernel on CPU in float32 (`kvgate.models.prefill_attention`: in place, causal blocks skipped,
4x SDPA's speed at 256 tokens), else the SDPA path above.

On CPU in float32 the glue between the matmuls is kvgate's own C++ (kvgate/models/csrc/layer_ops.cpp):
RMSNorm fused with the residual add, and RoPE fused with the K/V write, one call each where the
PyTorch expressions make 5-9 (1.2x a whole decode step at 1-4 rows). RoPE and the write are bit for
bit the PyTorch expressions; RMSNorm differs from F.rms_norm by its sum's order only (an ulp).

A step whose tokens are all decode rows, on a model whose every layer kernel is kvgate's own
(`--weights gguf` or `gguf-q8act`, paged attention), runs the layer loop below as one C++ call
(`kvgate.models.decode_stack`): the same kernels in the same order, so the same bits, without the
loop's Python between them.

On CPU in float32 every weight matrix is prepacked once for oneDNN (`kvgate.models.linear`): 2.5-3x
faster batched matmuls, and a row's matmul results no longer depend on how many rows share the step.
The paged kernel gives decode attention the same property; the gather path's CPU SDPA does not (a
row's output moves by ~1e-6 with the rows beside it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kvgate.config import ModelSpec
from kvgate.models import decode_stack, huge_pages, native, rope
from kvgate.models.block_formats import BlockLinear, fused_names, fused_scales
from kvgate.models.block_formats import held as held_blocks
from kvgate.models.head_blocks import BlockTable, head_name, head_scales
from kvgate.models.head_blocks import build as build_head
from kvgate.models.linear import Linear, packs_weights
from kvgate.models.paged_attention import gather_attention, window_mask
from kvgate.models.paged_attention import kernel as paged_kernel
from kvgate.models.prefill_attention import run as run_prefill
from kvgate.models.prefill_attention import sdpa as prefill_attention  # the SDPA path (tests call it here)
from kvgate.models.prefill_attention import unsupported as unsupported_prefill
from kvgate.models.q4_1 import Q41Linear
from kvgate.models.q4_1_dot8 import Q41Dot8Linear
from kvgate.models.q8_head import Q8DotTable, Q8Table, q8_blocks
from kvgate.models.quant import GGUF_FORMATS, Quantized, quantizable
from kvgate.models.step_batch import DecodeGroup, PrefillSpan, StepBatch, matmul_shapes

__all__ = ["DecodeGroup", "LlamaModel", "PrefillSpan", "StepBatch", "matmul_shapes", "prefill_attention"]

if TYPE_CHECKING:
    from kvgate.core.kv_cache import KVPool


class LlamaModel:
    def __init__(
        self,
        spec: ModelSpec,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype,
        device,
        pack: bool | None = None,
        weights_format: str = "full",
        act: torch.dtype = torch.bfloat16,
        q8_head: bool = False,
        head_blocks: str | None = None,
        paged_attention: bool = False,
        prefill_kernel: bool = False,
        block_scales: Mapping[str, torch.Tensor] | None = None,
        rope_positions: int | None = None,
    ):
        """`pack`: prepack the weight matrices (`Linear`); None = wherever `packs_weights` says.
        `weights_format` int8 / int4: hold every layer matrix that allows it quantized (`Quantized`),
        its kernels running in `act` activations (the plan's `weight_bytes` counts the same bytes).
        `q8_head`: hold the tied embedding table as its exact Q8_0 blocks (`kvgate.models.q8_head`),
        for the lookup and the LM head alike; placement decides (`kvgate.core.placement`).
        `head_blocks`: hold the LM head as the file's blocks in this tile format (`kvgate.models.head_blocks`;
        placement decides).
        `paged_attention`: run decode attention with the paged CPU kernel (`kvgate.models.paged_attention`;
        the caller has checked it builds and chosen it by its probe), else gather + SDPA per group.
        `prefill_kernel`: run prompt-chunk attention with the paged CPU kernel
        (`kvgate.models.prefill_attention`, chosen by its probe), else gather + SDPA per chunk.
        `block_scales`: a converted GGUF's d and m per layer matrix, with which `--weights gguf` holds
        matrices of any block type as the file's blocks (`kvgate.models.block_formats`).
        `rope_positions`: the RoPE tables' length, the engine's context (None: the model's whole context)."""
        self.spec = spec
        self.dtype = dtype
        self.device = torch.device(device)
        self.weights_format = weights_format
        if paged_attention and (self.device.type != "cpu" or paged_kernel() is None):
            raise ValueError(f"the paged decode attention kernel cannot run here ({self.device}); use gather")
        self.paged_attention = paged_attention
        why = unsupported_prefill(self.device, dtype, spec.head_dim) if prefill_kernel else None
        if why is not None:
            raise ValueError(f"the prefill attention kernel cannot run here: {why}")
        self.prefill_kernel = native.extension() if prefill_kernel else None
        # float32 on CPU: RMSNorm and RoPE + K/V write by kvgate's C++ ops (kvgate/models/csrc/layer_ops.cpp)
        self.layer_ops = native.extension() if self.device.type == "cpu" and dtype == torch.float32 else None
        quant = weights_format != "full"
        self.packed = packs_weights(self.device, dtype) if pack is None else pack

        def w(name: str) -> torch.Tensor:
            return weights.pop(name).to(device=self.device, dtype=dtype).contiguous()

        def mat(name: str) -> torch.Tensor:  # gguf blocks are recovered from the checkpoint's float32
            keep = torch.float32 if weights_format in GGUF_FORMATS else dtype
            return weights.pop(name).to(device=self.device, dtype=keep).contiguous()

        def lin(
            weight: torch.Tensor, bias: torch.Tensor | None = None, head: bool = False, names: tuple = ()
        ) -> Linear | Quantized | Q41Linear | Q41Dot8Linear | BlockLinear:
            if weights_format in GGUF_FORMATS and not head and quantizable(weights_format, *weight.shape):
                if weights_format == "gguf-q8act":
                    return Q41Dot8Linear(weight, bias)
                return held_blocks(weight, bias, fused_scales(block_scales, names))
            if (
                quant
                and weights_format not in GGUF_FORMATS
                and not head
                and quantizable(weights_format, *weight.shape)
            ):
                return Quantized(weights_format, weight, bias, act)
            return Linear(weight.to(dtype), bias, self.packed)

        def opt(name: str) -> torch.Tensor | None:
            return w(name) if name in weights else None

        self.q8: Q8Table | BlockTable | None = None
        block_head = None  # the head as the file's blocks: built first, from the checkpoint's float32
        if head_blocks:  # values (a narrower dtype's rounding is not the blocks), before the layers (review)
            name = head_name(weights)
            block_head = build_head(
                weights.pop(name).to(torch.float32), head_scales(block_scales, name), head_blocks
            )
            if name == "model.embed_tokens.weight":  # the lookup reads rows out of the tiles too
                self.q8 = BlockTable(block_head)
        if q8_head:
            blocks = q8_blocks(weights.pop("model.embed_tokens.weight").to(torch.float32))
            if blocks is None or "lm_head.weight" in weights:
                raise ValueError("q8_head needs tied embeddings that are exact Q8_0 blocks (see q8_blocks)")
            table = Q8DotTable if weights_format == "gguf-q8act" else Q8Table  # the head as the layers
            self.q8 = table(*(t.to(self.device) for t in blocks))
        self.embed = self.q8 if self.q8 is not None else w("model.embed_tokens.weight")

        def fused(names: tuple[str, ...], bias: torch.Tensor | None = None):
            parts = [mat(n) for n in names]  # read, fused and held one matrix at a time
            return lin(parts[0] if len(parts) == 1 else torch.cat(parts), bias, names=names)

        self.layers = []
        for i in range(spec.num_layers):
            p, names = f"model.layers.{i}.", fused_names(i)  # qkv, o, gate_up, down
            biases = [opt(p + f"self_attn.{n}_proj.bias") for n in "qkv"]
            qkv_bias = torch.cat(biases) if all(b is not None for b in biases) else None
            self.layers.append(
                (
                    w(p + "input_layernorm.weight"),
                    fused(names[0], qkv_bias),
                    fused(names[1]),
                    w(p + "post_attention_layernorm.weight"),
                    fused(names[2]),
                    fused(names[3]),
                )
            )
        self.norm = w("model.norm.weight")
        self.windows = [spec.sliding_window if i in spec.window_layers else 0 for i in range(spec.num_layers)]
        # Qwen3: each q and k head's RMSNorm weights [head_dim], per layer (`qk_norm`)
        self.qk_norms = (
            [
                tuple(w(f"model.layers.{i}.self_attn.{n}_norm.weight") for n in "qk")
                for i in range(spec.num_layers)
            ]
            if spec.qk_norm
            else None
        )
        # Tied embeddings: the lookup needs the plain table, so a packed head is a second copy (the
        # plan charges it: `kvgate.memory.plan.weight_bytes(..., lm_head_copy=True)`).
        # The head stays in the model dtype under --weights int8/int4, as GPTQ and AWQ checkpoints keep
        # it: quantizing it moved SmolLM2's greedy tokens within 2-4 steps on half the test prompts
        # (its GGUF embeddings are Q8_0, finer than int4 or per-channel int8), the layers alone did not.
        if self.q8 is not None:
            self.lm_head = self.q8
        elif block_head is not None:  # untied (a tied one is the BlockTable above)
            self.lm_head = block_head
        else:
            self.lm_head = lin(
                self.embed if "lm_head.weight" not in weights else w("lm_head.weight"), head=True
            )
        cos, sin = rope.tables(  # see rope.py
            spec.rope_theta,
            spec.head_dim,
            rope_positions or spec.max_position_embeddings,
            dict(spec.rope_scaling),
        )
        self.cos, self.sin = cos.to(device=self.device, dtype=dtype), sin.to(device=self.device, dtype=dtype)
        # the Q4_1 layer tiles and the Q8 table, streamed whole by every decode step, on huge pages
        self.huge_page_bytes = huge_pages.move(self._streamed()) if self.device.type == "cpu" else 0
        # decode-only steps run the layers in one C++ call where every kernel is kvgate's own
        self.decode_stack = decode_stack.build(self)

    def _streamed(self) -> list[tuple[object, str]]:
        """(owner, attribute) of each kvgate-packed weight tensor: the Q4_1 layer tiles and the Q8 table."""
        out: list[tuple[object, str]] = [
            (lin, "packed")
            for layer in self.layers
            for lin in layer
            if isinstance(lin, (Q41Linear, Q41Dot8Linear, BlockLinear))
        ]
        if isinstance(self.q8, Q8DotTable):
            out.append((self.q8, "packed"))
        elif isinstance(self.q8, Q8Table):
            out.append((self.q8, "tiles"))
        elif isinstance(self.q8, BlockTable):
            out.append((self.q8.head, "packed"))
        elif isinstance(self.lm_head, BlockLinear):  # an untied head held as blocks
            out.append((self.lm_head, "packed"))
        return out

    def set_row_buckets(self, step_tokens: int, logit_rows: int) -> None:
        """Round each matmul's rows up to the buckets `warm_kernels` ran (see kvgate.models.linear)."""
        for layer in self.layers:
            for lin in layer[1:3] + layer[4:]:  # qkv, o, gate_up, down
                if isinstance(lin, Linear):
                    lin.bucket_rows(step_tokens)
        if isinstance(self.lm_head, Linear):
            self.lm_head.bucket_rows(logit_rows)

    @property
    def weight_bytes(self) -> int:
        tensors = [self.norm, self.cos, self.sin] + ([] if self.q8 is not None else [self.embed])
        tensors += [t for pair in self.qk_norms or () for t in pair]
        linears = [self.lm_head] if getattr(self.lm_head, "weight", None) is not self.embed else []
        for ln1, qkv, o, ln2, gu, down in self.layers:
            tensors += [ln1, ln2]
            linears += [qkv, o, gu, down]
        return sum(t.numel() * t.element_size() for t in tensors) + sum(lin.nbytes for lin in linears)

    @torch.inference_mode()
    def forward(self, batch: StepBatch, kv: KVPool) -> torch.Tensor:
        """Run one step; return float32 logits `[len(batch.logits_index), vocab]`."""
        s = self.spec
        H, KVH, D = s.num_heads, s.num_kv_heads, s.head_dim
        T = batch.input_ids.shape[0]
        eps = s.rms_norm_eps
        ops = self.layer_ops
        n_dec = 0 if batch.decode_lens is None else batch.decode_lens.shape[0]
        stacked = self.decode_stack is not None and n_dec == T  # every token a decode row
        if stacked:
            cos = sin = None  # the stack looks its positions' rows up itself
        elif ops is not None:  # C++ RMSNorm (+ the residual add) and RoPE + K/V write, one call each
            cos = self.cos[batch.positions]
            sin = self.sin[batch.positions]
        else:
            cos = self.cos[batch.positions].unsqueeze(1)
            sin = self.sin[batch.positions].unsqueeze(1)
        x = self.embed_tokens(batch.input_ids)
        pending = None  # the last residual branch, added to x by the next norm
        if stacked:  # the same kernels in the same order in one C++ call (kvgate.models.decode_stack)
            x = self.decode_stack.run(
                x,
                kv.k,
                kv.v,
                self.cos,
                self.sin,
                batch.positions,
                batch.slots,
                batch.decode_tables,
                batch.decode_lens,
                kv.k_scale,
                kv.v_scale,
            )
        for li, (ln1, qkv_proj, o_proj, ln2, gate_up_proj, down_proj) in enumerate(
            () if stacked else self.layers
        ):
            if ops is not None:
                k_pool, v_pool = kv.k[li], kv.v[li]
                h = ops.rms_norm(x, ln1, eps) if pending is None else ops.add_rms_norm_(x, pending, ln1, eps)
                qkv = self.qk_norm(li, qkv_proj(h, n_dec))
                ops.rope_write_kv_(qkv, H, KVH, cos, sin, batch.slots, k_pool, v_pool, *kv.scales(li))
                q = qkv[:, : H * D].view(T, H, D)
            else:
                x, q = self.glue_in(li, x, pending, cos, sin, batch.slots, kv, n_dec)
            attn = self.attend(li, q, batch, kv, n_dec)
            if ops is not None:
                o = o_proj(attn, n_dec)
                h = ops.add_rms_norm_(x, o, ln2, eps)
                gu = gate_up_proj(h, n_dec)
                pending = down_proj(ops.silu_mul(gu), n_dec)
            else:
                x, pending = self.glue_out(li, x, attn, n_dec)
        if pending is not None:
            x = x + pending
        return self.logits(x[batch.logits_index])

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """The hidden states `[T, hidden]` of token ids: the Q8_0 table's rows, or the plain embedding."""
        return self.q8.embed(ids, self.dtype) if self.q8 is not None else F.embedding(ids, self.embed)

    def logits(self, rows: torch.Tensor) -> torch.Tensor:
        """Float32 logits of final hidden states: the last RMSNorm (C++ where the layer ops built), the head."""
        eps, ops = self.spec.rms_norm_eps, self.layer_ops
        h = (
            ops.rms_norm(rows, self.norm, eps)
            if ops is not None
            else F.rms_norm(rows, rows.shape[-1:], self.norm, eps)
        )
        return self.lm_head(h).float()

    def glue_in(self, li: int, x, pending, cos, sin, slots, kv: KVPool, n_dec: int):
        """Layer `li` up to its attention, in PyTorch ops: the last residual branch added, RMSNorm, the
        fused qkv matmul, RoPE on q and k, the new K/V written at `slots`. Returns (x, q [T, H, D])."""
        s = self.spec
        H, KVH, D = s.num_heads, s.num_kv_heads, s.head_dim
        T, half = x.shape[0], D // 2
        ln1, qkv_proj = self.layers[li][:2]
        if pending is not None:
            x = x + pending
        h = F.rms_norm(x, (s.hidden_size,), ln1, s.rms_norm_eps)
        qkv = self.qk_norm(li, qkv_proj(h, n_dec))
        qk = qkv[:, : (H + KVH) * D].view(T, H + KVH, D)
        rot = torch.cat((-qk[..., half:], qk[..., :half]), dim=-1)
        qk = qk * cos + rot * sin
        kv.write(li, slots, qk[:, H:], qkv[:, (H + KVH) * D :].view(T, KVH, D))
        return x, qk[:, :H]

    def qk_norm(self, li: int, qkv: torch.Tensor) -> torch.Tensor:
        """Layer `li`'s fused q/k/v rows with each q and k head RMS-normed in place (Qwen3), else as given."""
        if self.qk_norms is None:
            return qkv
        s = self.spec
        H, KVH, D, T = s.num_heads, s.num_kv_heads, s.head_dim, qkv.shape[0]
        if self.layer_ops is not None:  # the decode stack's row function: the same bits
            self.layer_ops.qk_norm_(qkv, H, KVH, *self.qk_norms[li], s.rms_norm_eps)
            return qkv
        for (lo, heads), weight in zip(((0, H), (H * D, KVH)), self.qk_norms[li]):
            part = qkv[:, lo : lo + heads * D].view(T, heads, D)
            part.copy_(F.rms_norm(part, (D,), weight, s.rms_norm_eps))
        return qkv

    def attend(self, li: int, q, batch: StepBatch, kv: KVPool, n_dec: int, out=None):
        """Layer `li`'s attention for every token of the step, `[T, H * D]` (into `out` when given): the
        decode rows by the paged kernel or by gather + SDPA per group, each prompt chunk by the prefill
        kernel or SDPA."""
        s = self.spec
        H, D = s.num_heads, s.head_dim
        T = batch.input_ids.shape[0]
        k_pool, v_pool = kv.k[li], kv.v[li]
        scales = kv.scales(li)  # an int8 pool's (k_scale, v_scale); (None, None) otherwise
        W = self.windows[li]  # Gemma's sliding layers: only the last W positions (0: all)
        if self.paged_attention and n_dec:  # every decode row in one call, reading the pool in place
            od = paged_kernel()(
                q[:n_dec], k_pool, v_pool, batch.decode_tables, batch.decode_lens, D**-0.5, *scales, W
            )
            if n_dec == T and out is None:
                return od.view(T, H * D)
            attn = out if out is not None else torch.empty((T, H * D), dtype=q.dtype, device=q.device)
            attn[:n_dec] = od.view(n_dec, H * D)
        else:
            attn = out if out is not None else torch.empty((T, H * D), dtype=q.dtype, device=q.device)
            for grp in batch.decode_groups:
                qg = q[grp.start : grp.end]
                mask = window_mask(grp.lens, grp.width, W) if W else grp.mask
                og = gather_attention(qg, k_pool, v_pool, grp.block_tables, mask, *scales)
                attn[grp.start : grp.end] = og.reshape(grp.end - grp.start, H * D)
        for pf in batch.prefills:
            if self.prefill_kernel is not None:  # in place: no gathered context, no mask
                rows = attn[pf.start : pf.start + pf.q_len]
                run_prefill(self.prefill_kernel, rows, q, k_pool, v_pool, pf, D**-0.5, *scales, window=W)
            else:
                attn[pf.start : pf.start + pf.q_len] = prefill_attention(
                    q, k_pool, v_pool, pf, *scales, window=W
                )
        return attn

    def glue_out(self, li: int, x, attn, n_dec: int):
        """Layer `li` after its attention, in PyTorch ops: the output projection added to the residual,
        RMSNorm, the fused gate/up matmul, SiLU(gate) * up, the down projection. Returns (x, the MLP's
        branch, which the next layer's `glue_in` adds)."""
        s = self.spec
        _, _, o_proj, ln2, gate_up_proj, down_proj = self.layers[li]
        x = x + o_proj(attn, n_dec)
        h = F.rms_norm(x, (s.hidden_size,), ln2, s.rms_norm_eps)
        gu = gate_up_proj(h, n_dec)
        inter = gu.shape[-1] // 2
        return x, down_proj(F.silu(gu[:, :inter]) * gu[:, inter:], n_dec)
