"""The step workspace: the peak bytes one engine step can allocate, term by term, from its limits.

`step_workspace(spec, dtype_bytes, limits)` is the formula the memory plan reserves and the memory
probes check a real step against (tests/test_memory.py, tests/memory_probe.py). A term is either
standing (alive for the whole step, summed) or transient (one at a time on top, the largest taken).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvgate.config import ModelSpec
from kvgate.models.quant import quantizable
from kvgate.sampling import SAMPLE_ROWS
from kvgate.structured import compiler as grammar


@dataclass
class StepLimits:
    prefill_chunk: int
    max_seqs: int
    attn_token_cap: int  # padded decode-attention tokens per group (rows x longest context)
    max_model_len: int
    # The longest context a row can reach: max_model_len, or the whole KV pool when that is smaller
    # (a row never holds more positions than the pool has). The attention terms are sized for it.
    attn_context: int | None = None
    # Weights prepacked for oneDNN (kvgate.models.linear): no MKL sgemm packing buffers, but a padded
    # copy of a matmul's input; oneDNN's own kernel memory is warmed up into the measured overhead.
    packed_weights: bool = False
    # CPU matmuls on float weights pad their rows to a bucket (kvgate.models.linear), packed or not, so a
    # row's bits never depend on the rows beside it: a padded copy of the input, one call at a time.
    padded_rows: bool = False
    # Weight-only quantized matrices (kvgate.models.quant, `--weights int8|int4`): each call casts
    # its input to the activation dtype and gets its output in it before the cast back.
    weight_format: str = "full"
    quant_act_bytes: int = 2
    # Speculative decoding (kvgate.core.speculate): every decoding row may add this many draft tokens
    # to a step, each wanting logits. The step's budget reserves them for every row.
    speculate: int = 0
    # The tied embedding table held as Q8_0 blocks (kvgate.models.q8_head): a lookup widens the rows.
    q8_head: bool = False
    # The tied table held only as the head's block tiles (kvgate.models.head_blocks.BlockTable): a lookup
    # gathers the rows' tile-blocks and widens their codes and scales.
    block_lookup: bool = False
    # Prefill attention by SDPA's fused CPU kernel (kvgate.models.llama passes it the grouped heads and
    # a [chunk, context] mask): no score matrix is made. False (CUDA: a masked chunk with grouped heads
    # takes the math path) charges the materialized scores.
    flash_prefill: bool = False
    # Bytes per K/V value in the pool (`--kv-dtype`); 0 = the model dtype's.
    kv_bytes: int = 0
    # Bytes of scale per position and KV head (an int8 pool's float32 scales), gathered with the codes.
    kv_scale_bytes: int = 0
    # --weights gguf's prompt rows on AMX bf16 tiles (kvgate/models/csrc/amx_q4_1.cpp): each call also
    # holds its prompt rows as three bf16 parts and block sums, and the matrix's codes widened to bf16.
    amx_prefill: bool = False
    # Distinct structured-output grammars kept at once, cached or running (`--max-grammars`,
    # kvgate.structured.compiler); 0 = structured output off, and no grammar memory at all.
    grammars: int = grammar.AUTO_SLOTS

    @property
    def context(self) -> int:
        return self.attn_context or self.max_model_len

    @property
    def max_step_tokens(self) -> int:
        return self.prefill_chunk + self.max_seqs * (1 + self.speculate)

    @property
    def max_logit_rows(self) -> int:
        return self.max_seqs * (1 + self.speculate)


# Terms of `step_workspace` that stay allocated together for a whole step (summed), and the
# transients of which only one is alive at a time on top of them (the largest is taken).
STANDING_TERMS = (
    "step_inputs",
    "layer_activations",
    "kernel_scratch",
    "row_state",
    "penalty_state",
    "grammar",
    "gemma",
)
TRANSIENT_TERMS = (
    "embedding",
    "rms_norm",
    "qk_norm",
    "block_lookup",
    "residual",
    "rope",
    "decode_attention",
    "prefill_attention",
    "mlp",
    "logits",
)

GEMM_PANEL_COLUMNS = 4096  # MKL sgemm packs at most K x 4096 float32 of a weight per call (measured)
KERNEL_SLACK = 1 << 20  # flash-attention per-thread blocks, small index temporaries, page rounding
# vocab-sized float32 temporaries per row of a sampling group (kvgate.sampling.sample_batch): the
# PyTorch draw measured at most 3.6 (4 rows, top-p with the full-sort fallback and penalties); the C++
# draw (kvgate/models/csrc/draw.cpp) at most 3.1 a thread, one thread a row of up to SAMPLE_ROWS, plus
# one processed row's copy; rounded up
SAMPLING_TEMPS = 5
# a row's bad_words (kvgate.server.vllm_extras, packed by SamplingParams.pack): at most 1,024 token ids
# as 32-bit arrays (up to 128 of them, 64 B each) and a deque of up to 1,023 drawn ids (8 B slots, the
# ints the row's token list holds); rounded up
BAD_WORDS_BYTES = 24 << 10
ROW_FIXED_BYTES = 16 << 10  # per running row: Row, sampler + torch.Generator, stop matcher, detokenizer
# per position of a row: prompt ids / prompt / tokens list slots (3 x 8 B) and the int (28 B); for a
# generated token also its time (24 B + a slot), text piece and the Token event until it is read
ROW_BYTES_PER_POSITION = 256
# a speculating row's n-gram index (kvgate.core.speculate.NgramIndex): up to three tuple keys per
# position of its history; measured 297-315 B per position with tracemalloc (512 to 8192 distinct
# tokens), rounded up
NGRAM_BYTES_PER_POSITION = 384
# a speculating row's `prediction` (kvgate.core.predicted): its token list, at most one token per
# position of the context, an 8 B slot and a 28-32 B int; rounded up. Without --speculate the engine
# drops a prediction's tokens at submit, so nothing is held.
PREDICTION_BYTES_PER_POSITION = 64


def padded_len(max_model_len: int, block_size: int) -> int:
    """A row's context rounded up to whole KV blocks: what one row's attention gathers at most."""
    return -(-max_model_len // block_size) * block_size


def step_workspace(
    spec: ModelSpec, dtype_bytes: int, limits: StepLimits, block_size: int = 16
) -> dict[str, int]:
    """Peak bytes of one engine step, by term, from the step limits the engine enforces.

    The forward (`kvgate.models.llama`) keeps its per-layer tensors in Python locals, so the newest
    of each (hidden states, fused qkv, rotated q/k, attention output, gate/up output, the last decode
    group's gathered K/V and the last prefill span's) stay alive together until the next layer
    rebinds them: those are `layer_activations`, counted in full. On top of them one transient at a
    time is alive: RMSNorm's float32 temporaries, a residual add, RoPE, one decode group's attention,
    one prefill chunk's attention (`_prefill_attention`), the MLP, or the logits of the batch with one
    row's sampling. `workspace_total` adds the standing terms and the largest transient; every term
    was checked against a measured step (tests/test_memory.py, tests/memory_probe.py).
    """
    b, f = dtype_bytes, 4
    C, S = limits.prefill_chunk, limits.max_seqs
    T = limits.max_step_tokens
    K1 = 1 + limits.speculate  # positions a decoding row brings to a step (its token and the drafts)
    LR = limits.max_logit_rows
    H, KVH, D = spec.num_heads, spec.num_kv_heads, spec.head_dim
    h, inter, V = spec.hidden_size, spec.intermediate_size, spec.vocab_size
    Lp = padded_len(limits.context, block_size)
    cap = limits.attn_token_cap
    QK = T * (H + KVH) * D * b  # rotated q and k of the step
    kvb = limits.kv_bytes or b
    # one position's K (or V) across the KV heads, as gathered: in the pool's dtype, and converted to the
    # model's when the two differ (--kv-dtype; the paged decode kernel reads the pool in place)
    kv_tok = KVH * D * (kvb + (b if kvb != b else 0)) + KVH * limits.kv_scale_bytes
    upcast = b != 4  # float16/bfloat16: math SDPA and RMSNorm work in float32, logits are cast
    gemms = [(h, (H + 2 * KVH) * D), (H * D, h), (h, 2 * inter), (inter, h), (h, V)]
    return {
        # ids, positions, slots; logits index; decode block tables and masks; prefill masks (on CUDA
        # also their host copies); per-span block tables; gathered cos/sin
        "step_inputs": 3 * T * 8
        + LR * 8
        + cap // block_size * 8
        + cap
        + 2 * C * Lp
        + S * (Lp // block_size) * 8
        + 2 * T * D * b * spec.rope_sets
        # draft positions (speculation) run as decode rows of their own: a mask and a block table each
        + (LR - S) * (Lp + Lp // block_size * 8)
        # every decode row's block table and context length, for the paged kernel (build_step)
        + LR * (Lp // block_size + 1) * 8,
        # x, h, fused qkv, rotated qk and its rotate-half copy, attention output, gate/up output,
        # a decode group's gathered K and V and its output, a prefill span's q, gathered K/V and output
        "layer_activations": T * (2 * h + (H + 2 * KVH) * D + 2 * (H + KVH) * D + H * D + 2 * inter) * b
        + 2 * cap * kv_tok
        + LR * H * D * b
        + 2 * C * H * D * b
        + 2 * Lp * kv_tok,
        # matmul scratch (`_gemm_scratch`) + attention kernel blocks
        "kernel_scratch": _gemm_scratch(gemms, T, b, limits) + KERNEL_SLACK,
        # what every running row holds between steps: its objects and token lists at full context
        "row_state": S * (Lp * ROW_BYTES_PER_POSITION + ROW_FIXED_BYTES)
        + (S * Lp * (NGRAM_BYTES_PER_POSITION + PREDICTION_BYTES_PER_POSITION) if limits.speculate else 0),
        # a row with repetition/presence/frequency penalties: a bool seen-mask and float32 counts over
        # the vocabulary (zero pages until written: a row reaches this after touching most of the vocab);
        # with vLLM's allowed_token_ids, a bit per vocabulary entry (the mask a draw unpacks is one of
        # SAMPLING_TEMPS' vocab-sized temporaries); with bad_words, their ids and the tail they match
        "penalty_state": S * (V * 5 + V // 8 + 1 + BAD_WORDS_BYTES),
        # structured output (kvgate.structured): the grammar engine's token trie, the grammars kept (a
        # slot each, shared by all the rows of one grammar) and one compile in hand, each row's matcher
        # and packed mask, and one row's unpacked mask; none of it with --max-grammars 0
        "grammar": (
            V * grammar.TOKENIZER_BYTES_PER_TOKEN
            + (limits.grammars + 1) * grammar.GRAMMAR_BYTES
            + S * (4 * ((V + 31) // 32) + grammar.MATCHER_ROW_BYTES)
            + V
        )
        if limits.grammars
        else 0,
        # Gemma 3 (kvgate.models.gemma): a sliding layer's window masks off the kernels (a decode group's
        # and a prompt chunk's, bool, with their two comparison temporaries, and the positions they
        # compare), an output norm's input beside the residual, the scaled embeddings beside the looked-up
        # ones, q times the query scale, the layer's half of the gathered cos and sin made contiguous
        "gemma": 3 * (cap + C * Lp) + 16 * Lp + 2 * T * h * b + T * H * D * b + 2 * T * D * b
        if spec.architecture == "gemma3"
        else 0,
        # transients, one at a time:
        # a Q8 table's lookup: the rows' codes and scales, and their float32 widening when the model
        # dtype is narrower (in float32 the widened rows are the hidden states themselves)
        "embedding": (T * h + T * (h // 32) * 4 + (T * h * f if b != f else 0)) if limits.q8_head else 0,
        # a block table's lookup: the gathered tile-blocks of 16 rows each (at most 1.5 B a value), codes
        # as int32 and float32, the widened rows (`tile_rows`)
        "block_lookup": T * h * (16 * 3 // 2 + 4 + 4 + f) if limits.block_lookup else 0,
        "rms_norm": 3 * T * h * f + T * h * b,
        # Qwen3's q/k head norms off the C++ path (F.rms_norm's output, float32 inside for 16-bit dtypes)
        "qk_norm": T * (H + KVH) * D * (f + b) if spec.qk_norm else 0,
        "residual": 2 * T * h * b,
        "rope": 2 * QK,
        # the next group's K (or V) gathered while this one's is alive, its output, the float mask
        "decode_attention": cap * kv_tok + LR * H * D * b + cap * f,
        "prefill_attention": _prefill_attention(C, Lp, H, KVH, D, b, kv_tok, limits.flash_prefill),
        # gate/up output while the previous layer's is alive; SiLU and the product
        "mlp": 2 * T * inter * b,
        # the sampled rows' hidden states and norm, logits in the model dtype and as float32, and the
        # sampling temporaries of one group of rows drawn together (kvgate.sampling.SAMPLE_ROWS); under
        # gguf-q8act the Q8 head's input as 8-bit blocks
        "logits": LR * h * (2 * b + 3 * f)
        + (LR * (h + h // 32 * 8) if limits.q8_head and limits.weight_format == "gguf-q8act" else 0)
        + LR * V * b
        + (LR * V * f if upcast else 0)
        + SAMPLING_TEMPS * min(max(S, K1), SAMPLE_ROWS) * V * f,
    }


def _prefill_attention(C: int, Lp: int, H: int, KVH: int, D: int, b: int, kv_tok: int, flash: bool) -> int:
    """One prefill chunk's attention transient (C queries over Lp positions), plus the next span's gather
    (`kv_tok` bytes a position). These are the SDPA path's; the CPU prefill kernel
    (`kvgate.models.prefill_attention`) writes into the step's attention output and keeps ~50 KiB of
    scratch a thread, so the same term bounds it too (tests/test_prefill_kernel.py measures it)."""
    f = 4
    if flash:
        # the float mask SDPA makes of the bool one and a bool temporary; the output, its row-major
        # copy and a float32 copy of q; the log-sum-exp per query. Measured (VmHWM of the chunk's
        # attention, float32 and bfloat16, chunks of 16-2048 over contexts up to 8192): 0.2-0.95 of this.
        return C * Lp * (f + 1) + C * H * D * (2 * b + f) + C * H * f + Lp * kv_tok
    # scores and softmax in float32 (+ a quarter for the -inf test), bool and float masks, scaled
    # q and k in float32 (upcast q/k/v first for 16-bit dtypes), the output; K and V repeated per
    # query head (the math path's `enable_gqa`; not measured: no CUDA machine was at hand)
    g, upcast = H // KVH, b != 4
    return (
        (9 * H * C * Lp * f) // 4
        + 2 * H * Lp * D * f
        + g * C * Lp * (f + 1)
        + (2 * C * H * D + Lp * KVH * D) * f
        + ((C * H * D + 2 * Lp * KVH * D) * f if upcast else 0)
        + 2 * C * H * D * b
        + Lp * kv_tok
    )


def _gemm_scratch(gemms: list[tuple[int, int]], T: int, b: int, limits: StepLimits) -> int:
    """Matmul scratch: MKL sgemm packing buffers (kept by MKL's allocator after first use), or with
    prepacked weights a matmul input padded to its row bucket; with quantized layer matrices also
    their input cast to the activation dtype and their output in it (gguf-q8act: also the input's
    8-bit blocks, a byte per value and two float32 per 32; gguf: its decode rows' 24-bit digits,
    three bytes per value, and their scale and float sum per 32 (csrc/q4_1_int24.cpp); gguf on AMX:
    `amx_prefill_bytes`)."""
    fmt = limits.weight_format
    quant = 0
    if fmt != "full":  # the layer matrices quantizable in `fmt` (the LM head, last, never is)
        blocks = 1 if fmt == "gguf-q8act" else 0
        amx = limits.amx_prefill and fmt == "gguf"
        digit_rows = min(T, limits.max_logit_rows) if fmt == "gguf" else 0  # decode and verify rows
        quant = max(
            (
                T * (k + n) * limits.quant_act_bytes
                + blocks * T * (k + k // 32 * 8)
                + digit_rows * (3 * k + k // 32 * 8)
                + (amx_prefill_bytes(T, k, n) if amx else 0)
                for k, n in gemms[:-1]
                if quantizable(fmt, n, k)
            ),
            default=0,
        )
        gemms = [g for i, g in enumerate(gemms) if i == len(gemms) - 1 or not quantizable(fmt, g[1], g[0])]
    pad = T * max(k for k, _ in gemms) * b if limits.packed_weights or limits.padded_rows else 0
    if limits.packed_weights:  # transient, one call at a time
        return max(quant, pad)
    return (
        max(quant, pad) + max(k * min(n, GEMM_PANEL_COLUMNS) for k, n in gemms) * 4
    )  # MKL keeps its buffers


def amx_prefill_bytes(rows: int, k: int, n: int) -> int:
    """What one AMX Q4_1 call holds beside its input and output (amx_q4_1.cpp's q4_1_prefill): the
    prompt rows, padded to 16, as three bf16 parts and a float32 sum per block of 32, and the [n, k]
    matrix's codes as bf16 (n padded to 16)."""
    rp, np_ = -(-rows // 16) * 16, -(-n // 16) * 16
    return rp * k * 6 + rp * (k // 32) * 4 + np_ * k * 2


def workspace_total(breakdown: dict[str, int]) -> int:
    """Standing terms plus the largest transient (transients never overlap)."""
    return sum(breakdown[k] for k in STANDING_TERMS) + max(breakdown[k] for k in TRANSIENT_TERMS)


def attn_cap(max_seqs: int, max_model_len: int, block_size: int = 16) -> int:
    """Padded decode-attention tokens per group: room for every row at 512 tokens, never less than one
    row at full context (padded to whole blocks, which is what a group gathers), and never more than
    every row at full context (no step can gather more)."""
    full = padded_len(max_model_len, block_size)
    return min(max_seqs * full, max(full, max_seqs * 512))


def workspace_bytes(spec: ModelSpec, dtype_bytes: int, limits: StepLimits, block_size: int = 16) -> int:
    return workspace_total(step_workspace(spec, dtype_bytes, limits, block_size))
