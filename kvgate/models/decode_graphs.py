"""Decode steps replayed from CUDA graphs captured at startup: one graph per (rows, blocks) bucket.

On CUDA an eager decode step launches thousands of small kernels (~4,100 PyTorch ops for SmolLM2-135M),
and launching them, not the GPU's work, sets its time. `DecodeGraphs` captures `LlamaModel.forward` once
per bucket pair of `kvgate.memory.graphs.graph_shapes` and replays the one a step's shape rounds up to:
on an H200 a 1-row engine step went from 27.2 to 2.8 ms, a 16-row one from 24.2 to 4.2 ms (session 27,
docs/DESIGN_NOTES.md).

Every graph reads the same static input buffer, laid out for its bucket from offset 0 as
`[ids | positions | slots | context lengths]` (one int64 per row each) then the `[rows, blocks]` block
table; one host-to-device copy fills it (`run`). Padding rows (token 0 at position 0, context 1) write
their K/V to `pad_block`, a KV block no request is given, and read only it; a real row's table is
padded with it too, and masked. The graph copies its logits into one static `[max rows, vocab]`
float32 buffer, so no graph keeps an output of its own in the shared pool.

The same forward on the same inputs: a replay computes what the eager forward of the padded batch
computes (checked bit for bit on a GPU, tests/test_cuda.py). Padding changes the matmuls' row count
and the attention's width, which on CUDA can move a row's logits in their last bits, as the number of
rows sharing an eager step already does.

`capture=False` runs the same padded static batches eagerly, with no graph: how the CPU tests check the
padding, the buffers and the runner's path without a GPU (`kvgate.core.testing.static_decode`).
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvgate.memory.graphs import INPUT_FIELDS, input_values, largest_first
from kvgate.models.llama import DecodeGroup, StepBatch

if TYPE_CHECKING:
    from kvgate.core.kv_cache import KVPool
    from kvgate.models.llama import LlamaModel

log = logging.getLogger("kvgate.models")

_capture_streams: dict[int, torch.cuda.Stream] = {}  # by device index


def measure_capture(device: torch.device, capture) -> tuple[int, str]:
    """Run `capture(pool, side_stream)` on `device` under inference mode, with one new graph pool and
    the device's capture stream. Returns the bytes PyTorch's allocator holds after it beyond before,
    its free blocks given back on both sides (the pool the plan charges), and a phrase saying what the
    capture cost: its seconds, that pool, and the drop in the driver's free memory, which also counts
    the instantiated graphs themselves, outside the allocator."""
    with torch.cuda.device(device):  # cuda:N, whichever device is current
        t0 = time.monotonic()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        before, free_before = torch.cuda.memory_reserved(), torch.cuda.mem_get_info()[0]
        with torch.inference_mode():
            capture(torch.cuda.graph_pool_handle(), capture_stream(device))
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        pool, driver = torch.cuda.memory_reserved() - before, free_before - torch.cuda.mem_get_info()[0]
        return pool, (
            f"captured in {time.monotonic() - t0:.1f}s, their pool holds {pool / (1 << 20):.1f} MiB (the "
            f"device's free memory fell {driver / (1 << 20):.1f} MiB, the graphs themselves included)"
        )


def drop_graphs(graphs: dict) -> None:
    """Drop captured graphs and give their pool back to the device."""
    graphs.clear()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The one side stream every capture on `device` uses, for the process's life. PyTorch keeps a cuBLAS
    workspace (32 MiB on Hopper) for each stream a matmul ran on until the process ends, so a fresh stream
    per engine would leave one more behind for each engine a process builds (tests, restarts). Every graph
    captured on it has that workspace baked in, so no two engines of one process may run graph work at
    the same time (one engine per process serves; tests build theirs one after another)."""
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index  # "cuda" and "cuda:0": one stream
    if index not in _capture_streams:
        _capture_streams[index] = torch.cuda.Stream(index)
    return _capture_streams[index]


@dataclass(slots=True)
class GraphStep:
    """One decode step for a graph: its bucket, its real rows, and the int64 values of its inputs."""

    shape: tuple[int, int]  # (rows, blocks) bucket
    rows: int  # real rows; rows [rows, shape[0]) are padding
    values: list[int]  # the bucket's inputs, laid out as the static buffer (input_values(*shape) long)


class DecodeGraphs:
    def __init__(
        self,
        model: LlamaModel,
        kv: KVPool,
        shapes: list[tuple[int, int]],
        pad_block: int,
        *,
        capture: bool = True,
    ):
        if not shapes:
            raise ValueError("no decode graph shape fits the attention cap")
        self.model, self.kv, self.pad_block, self.capture = model, kv, pad_block, capture
        self.block_size = kv.block_size
        self.shapes = set(shapes)
        self.row_sizes = sorted({r for r, _ in shapes})
        self.block_sizes = sorted({b for _, b in shapes})
        dev = model.device
        rows = self.row_sizes[-1]
        self.inputs = torch.zeros(max(input_values(*s) for s in shapes), dtype=torch.long, device=dev)
        self.index = torch.arange(rows, device=dev)
        self.out = torch.zeros((rows, model.spec.vocab_size), dtype=torch.float32, device=dev)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.order = largest_first(shapes)  # the pool's peak first: the smaller graphs reuse it
        self.pool_bytes = 0  # measured by capture_all
        self.replays = 0

    # ---- shapes and inputs (host side) --------------------------------------------------------
    def shape_for(self, rows: int, blocks: int) -> tuple[int, int] | None:
        """The captured bucket a step of `rows` rows whose longest spans `blocks` blocks rounds up to."""
        i = bisect.bisect_left(self.row_sizes, rows)
        j = bisect.bisect_left(self.block_sizes, blocks)
        if i == len(self.row_sizes) or j == len(self.block_sizes):
            return None
        shape = (self.row_sizes[i], self.block_sizes[j])
        return shape if shape in self.shapes else None

    def step(self, tokens: list[int], positions: list[int], tables: list[list[int]]) -> GraphStep | None:
        """The inputs of a step whose row r feeds `tokens[r]` at `positions[r]` over the blocks `tables[r]`
        (at least those its context spans), or None where no captured bucket holds it."""
        bs, pad = self.block_size, self.pad_block
        n = len(tokens)
        blocks = max(p // bs + 1 for p in positions)
        shape = self.shape_for(n, blocks)
        if shape is None:
            return None
        R, W = shape
        padding = R - n
        values = tokens + [0] * padding
        values += positions + [0] * padding
        values += [t[p // bs] * bs + p % bs for t, p in zip(tables, positions, strict=True)]
        values += [pad * bs] * padding
        values += [p + 1 for p in positions] + [1] * padding
        for t, p in zip(tables, positions, strict=True):
            used = p // bs + 1
            values += t[:used]
            values += [pad] * (W - used)
        values += [pad] * (W * padding)
        return GraphStep(shape, n, values)

    # ---- the device side --------------------------------------------------------------------------
    def _batch(self, shape: tuple[int, int]) -> StepBatch:
        """The model's batch for a bucket: views of the static input buffer."""
        R, W = shape
        buf = self.inputs
        ids, pos, slots, lens = (buf[i * R : (i + 1) * R] for i in range(INPUT_FIELDS))
        table = buf[INPUT_FIELDS * R : INPUT_FIELDS * R + R * W].view(R, W)
        group = DecodeGroup(0, R, table, lens, W * self.block_size)
        return StepBatch(ids, pos, slots, [group], [], self.index[:R], table, lens)

    def _forward(self, shape: tuple[int, int]) -> None:
        self.out[: shape[0]].copy_(self.model.forward(self._batch(shape), self.kv))

    def _fill_padding(self, shape: tuple[int, int]) -> None:
        """Every row a padding row: what the warm-up and capture run on (they write the pad block only)."""
        R, W = shape
        pad = self.pad_block * self.block_size
        values = [0] * R + [0] * R + [pad] * R + [1] * R + [self.pad_block] * (R * W)
        self.inputs[: len(values)].copy_(torch.tensor(values, dtype=torch.long))

    def capture_all(self) -> str:
        """Capture every shape, largest first, into one shared pool; return a line saying what it cost.
        Measures the pool (`pool_bytes`, see `measure_capture`)."""
        if not self.capture:
            return f"decode graphs: {len(self.shapes)} static shapes, run eagerly (no capture)"
        self.pool_bytes, cost = measure_capture(self.model.device, self._capture_each)
        return f"decode graphs: {len(self.graphs)} shapes {cost}"

    def _capture_each(self, pool, side: torch.cuda.Stream) -> None:
        for shape in self.order:
            self._fill_padding(shape)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # a first run picks the kernels (cuBLAS's heuristics)
                self._forward(shape)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=side):  # one stream: one cuBLAS workspace
                self._forward(shape)
            self.graphs[shape] = graph

    def release(self) -> None:
        """Drop every graph and give their pool back (the engine then runs eager steps)."""
        self.shapes = set()
        drop_graphs(self.graphs)

    def run(self, step: GraphStep) -> torch.Tensor:
        """Replay (or, without capture, run) the step's bucket; its real rows' float32 logits."""
        n = len(step.values)
        self.inputs[:n].copy_(torch.tensor(step.values, dtype=torch.long), non_blocking=False)
        if self.capture:
            self.graphs[step.shape].replay()
        else:
            with torch.inference_mode():
                self._forward(step.shape)
        self.replays += 1
        # a replay's logits are copied to the host by the runner; without capture (on a CPU) they would
        # be the buffer itself, which the next step overwrites
        return self.out[: step.rows] if self.capture else self.out[: step.rows].clone()
