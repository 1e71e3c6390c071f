"""The test seam: run a hook on the worker thread before each step's forward pass.

`set_step_hook(engine, hook)` makes every step call `hook(scheduler_output)` just before the model
runs; the hook may sleep (to keep requests in flight), block (to park the worker inside a step) or
raise (the step then fails exactly as a failing forward would). `set_step_hook(engine, None)` removes
it. Serving code never calls this module: the seam is a replaced method, not a check in the hot path.

`static_decode(engine)` sends its decode-only steps through the CUDA graphs' padded static batches,
run eagerly (no capture), so CPU tests reach that path.
"""

from __future__ import annotations

from collections.abc import Callable

from kvgate.core.kv_cache import KVPool
from kvgate.core.outputs import SchedulerOutput
from kvgate.memory.graphs import graph_shapes
from kvgate.models.decode_graphs import DecodeGraphs
from kvgate.models.step_pieces import StepPieces


def set_step_hook(engine, hook: Callable[[SchedulerOutput], object] | None) -> None:
    runner = engine.runner
    runner.__dict__.pop("forward", None)  # back to the class's own forward
    if hook is None:
        return
    plain = runner.forward

    def forward(so, batch):
        hook(so)
        return plain(so, batch)

    runner.forward = forward


def static_decode(engine, shapes: list[tuple[int, int]] | None = None) -> DecodeGraphs:
    """Run the engine's decode-only steps through `DecodeGraphs` without capture: the CUDA graphs' padded
    buckets, static buffers, pad block and runner path, eagerly, on any device (a CPU test's view of what
    a GPU replays). Call before any request: the KV pool is rebuilt with the pad block past the plan's.
    `shapes`: the (rows, blocks) buckets to have (default: the plan's, `graph_shapes`)."""
    p = engine.plan
    _with_pad_block(engine)
    graphs = DecodeGraphs(
        engine.model, engine.kv, shapes or graph_shapes(p.limits, p.block_size), p.kv_blocks, capture=False
    )
    engine.runner.graphs = graphs
    return graphs


def static_pieces(engine) -> StepPieces:
    """Run the engine's steps that carry prompt chunks (and decode steps no graph holds) through
    `StepPieces` without capture: the padded static buffers, the glue pieces and the eager attention
    between them, on any device. Call before any request (the KV pool is rebuilt with the pad block,
    as `static_decode` does)."""
    p = engine.plan
    _with_pad_block(engine)
    engine.pieces = StepPieces(engine.model, engine.kv, p.limits.max_step_tokens, p.kv_blocks, capture=False)
    return engine.pieces


def _with_pad_block(engine) -> None:
    """Rebuild the (still empty) KV pool with one block past the plan's, once."""
    p = engine.plan
    if engine.kv.num_blocks == p.kv_blocks:
        engine.kv = KVPool(engine.spec, p.kv_blocks + 1, p.block_size, engine.kv_dtype, engine.device)
