"""Steps that carry prompt chunks, on CUDA: the layers' glue replayed from graphs, attention run eagerly.

A decode-only step replays one whole graph (`kvgate.models.decode_graphs`). A step with prompt chunks
cannot: its attention's shapes follow each chunk's context. So, as vLLM v1's piecewise graphs do, the
step is cut at attention. For a bucket of T tokens (`kvgate.memory.graphs.token_buckets`) piece 0 is the embedding and
layer 0 up to its attention (`LlamaModel.glue_in`); piece l is layer l-1 after its attention
(`glue_out`) and layer l up to its own; piece L is the last layer's end. Each piece is captured once
per bucket; between two replays the layer's attention runs eagerly (`LlamaModel.attend`) on the
step's own `StepBatch`, reading the static q buffer and writing the static attention buffer. The final
norm and LM head run eagerly on the rows that want logits (`LlamaModel.logits`). A step of ~4,100 launches becomes L + 1
replays and each layer's attention ops.

Static buffers, shared by every bucket: token ids, positions and slots (int64), the hidden states, q
and the attention output. Tokens past the step's own, up to its bucket, are padding: token 0 at
position 0, writing its K/V to the pad block (`DecodeGraphs` keeps it too); their attention rows are
zeroed each step (attention writes the real rows only), and no logits row reads them.

`capture=False` runs the pieces eagerly from the same buffers (the CPU tests, through
`kvgate.core.testing.static_pieces`). Opt-in (`--cuda-graphs full`): not yet run on a GPU.
"""

from __future__ import annotations

import bisect
import contextlib
from typing import TYPE_CHECKING

import torch

from kvgate.memory.graphs import token_buckets
from kvgate.models.decode_graphs import drop_graphs, measure_capture

if TYPE_CHECKING:
    from kvgate.core.kv_cache import KVPool
    from kvgate.models.llama import LlamaModel, StepBatch


class StepPieces:
    def __init__(
        self, model: LlamaModel, kv: KVPool, max_tokens: int, pad_block: int, *, capture: bool = True
    ):
        self.model, self.kv, self.pad_block, self.capture = model, kv, pad_block, capture
        s, dev, dt = model.spec, model.device, model.dtype
        self.buckets = token_buckets(max_tokens)
        T = self.buckets[-1]
        self.ids = torch.zeros(T, dtype=torch.long, device=dev)
        self.pos = torch.zeros(T, dtype=torch.long, device=dev)
        self.slots = torch.full((T,), pad_block * kv.block_size, dtype=torch.long, device=dev)
        self.x = torch.zeros((T, s.hidden_size), dtype=dt, device=dev)
        self.q = torch.zeros((T, s.num_heads, s.head_dim), dtype=dt, device=dev)
        self.attn = torch.zeros((T, s.num_heads * s.head_dim), dtype=dt, device=dev)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.pool_bytes = 0
        self.replays = 0

    def bucket(self, tokens: int) -> int | None:
        i = bisect.bisect_left(self.buckets, tokens)
        return self.buckets[i] if i < len(self.buckets) else None

    def _piece(self, tb: int, li: int) -> None:
        """Piece `li` of a `tb`-token step, from the static buffers into them."""
        m = self.model
        L = len(m.layers)
        if li == 0:
            x, pending = m.embed_tokens(self.ids[:tb]), None
        else:
            x, pending = m.glue_out(li - 1, self.x[:tb], self.attn[:tb], 0)
        if li == L:
            self.x[:tb].copy_(x + pending)
            return
        pos = self.pos[:tb]
        cos, sin = m.cos[pos].unsqueeze(1), m.sin[pos].unsqueeze(1)
        x, q = m.glue_in(li, x, pending, cos, sin, self.slots[:tb], self.kv, 0)
        self.x[:tb].copy_(x)
        self.q[:tb].copy_(q)

    def capture_all(self) -> str:
        if not self.capture:
            return f"step pieces: {len(self.buckets)} token buckets, run eagerly (no capture)"
        self.pool_bytes, cost = measure_capture(self.model.device, self._capture_each)
        pieces = len(self.model.layers) + 1
        return f"step pieces: {len(self.graphs)} graphs ({len(self.buckets)} token buckets x {pieces} pieces) {cost}"

    def _capture_each(self, pool, side: torch.cuda.Stream) -> None:
        L = len(self.model.layers)
        for tb in reversed(self.buckets):  # largest first: the smaller reuse its pool
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for li in range(L + 1):  # a first run, every token padding: writes go to the pad block
                    self._piece(tb, li)
                for li in range(L + 1):
                    graph = torch.cuda.CUDAGraph()
                    graph.capture_begin(pool=pool)  # (torch.cuda.graph would gc.collect at each of these)
                    try:
                        self._piece(tb, li)
                    except BaseException:  # end the capture (an open one on the shared stream fails every
                        with contextlib.suppress(Exception):  # later one), and raise the piece's own error
                            graph.capture_end()
                        raise
                    graph.capture_end()
                    self.graphs[(tb, li)] = graph
            torch.cuda.current_stream().wait_stream(side)

    def release(self) -> None:
        self.buckets = []
        drop_graphs(self.graphs)

    def run(self, batch: StepBatch) -> torch.Tensor:
        """The step's float32 logits `[len(batch.logits_index), vocab]`, as `LlamaModel.forward` returns."""
        m = self.model
        T = batch.input_ids.shape[0]
        tb = self.bucket(T)
        if tb is None:  # the plan's most tokens a step is the last bucket: a scheduler bug
            raise RuntimeError(
                f"step pieces: a step of {T} tokens is over the largest bucket, {self.buckets[-1]}"
            )
        n_dec = 0 if batch.decode_lens is None else batch.decode_lens.shape[0]
        self.ids[:T].copy_(batch.input_ids)
        self.pos[:T].copy_(batch.positions)
        self.slots[:T].copy_(batch.slots)
        if tb > T:  # padding: token 0 at position 0, into the pad block
            self.ids[T:tb].zero_()
            self.pos[T:tb].zero_()
            self.slots[T:tb].fill_(self.pad_block * self.kv.block_size)
            self.attn[T:tb].zero_()  # attention writes real rows only: no stale value reaches the pad block
        L = len(m.layers)
        with torch.inference_mode():
            for li in range(L + 1):
                if self.capture:
                    self.graphs[(tb, li)].replay()
                else:
                    self._piece(tb, li)
                if li < L:
                    m.attend(li, self.q[:T], batch, self.kv, n_dec, out=self.attn[:T])
            self.replays += 1
            return m.logits(self.x[:T][batch.logits_index])
