"""The test seam: run a hook on the worker thread before each step's forward pass.

`set_step_hook(engine, hook)` makes every step call `hook(scheduler_output)` just before the model
runs; the hook may sleep (to keep requests in flight), block (to park the worker inside a step) or
raise (the step then fails exactly as a failing forward would). `set_step_hook(engine, None)` removes
it. Serving code never calls this module: the seam is a replaced method, not a check in the hot path.
"""

from __future__ import annotations

from collections.abc import Callable

from kvgate.core.outputs import SchedulerOutput


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
