"""A model built at 1 and at 2 threads holds the same bytes in every tensor: packed weights, scales,
norms and tables. Session 44 found torch's first parallel cos at load (after the decode-attention probe)
returning a wrong RoPE table in 9 of 20 loads; rope.py now builds it without torch's threads, and this
test walks everything else the engine builds at load (its probes included) for the same kind of fault.

Seen red with rope.tables' cos scaled by (1 + 1e-6 x torch.get_num_threads()) on purpose: one tensor,
`model.cos`, named in the failure."""

from __future__ import annotations

import hashlib

import pytest
import torch

from kvgate.config import EngineConfig
from kvgate.core.engine import Engine

pytestmark = pytest.mark.slow


def tensor_digests(obj, name: str = "model", out: dict | None = None, seen: set | None = None) -> dict:
    """name -> sha1 of the bytes of every tensor reachable from `obj` through kvgate's and torch.nn's
    objects (their __dict__ and __slots__), lists, tuples and dicts."""
    out = {} if out is None else out
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return out
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        t = t.to_dense() if t.is_mkldnn else t
        out[name] = hashlib.sha1(
            t.contiguous().cpu().view(-1).view(torch.uint8).numpy().tobytes()
        ).hexdigest()
    elif isinstance(obj, (list, tuple)):
        for i, x in enumerate(obj):
            tensor_digests(x, f"{name}[{i}]", out, seen)
    elif isinstance(obj, dict):
        for k, x in obj.items():
            tensor_digests(x, f"{name}.{k}", out, seen)
    elif type(obj).__module__.startswith(("kvgate", "torch.nn")):
        slots = [s for c in type(obj).__mro__ for s in getattr(c, "__slots__", ()) if hasattr(obj, s)]
        for k, x in [*getattr(obj, "__dict__", {}).items(), *((s, getattr(obj, s)) for s in slots)]:
            tensor_digests(x, f"{name}.{k}", out, seen)
    return out


def built_at(threads: int) -> dict:
    before = torch.get_num_threads()
    try:
        engine = Engine.from_model(
            "default", EngineConfig(threads=threads, memory_limit="3GiB", max_model_len=512)
        )
        return tensor_digests(engine.model)
    finally:
        torch.set_num_threads(before)


def test_the_model_built_at_one_and_two_threads_holds_the_same_bytes():
    one, two = built_at(1), built_at(2)
    layers = 30 * 6  # SmolLM2: two norms and four matrices a layer
    assert len(one) >= layers + 3, sorted(one)[:20]  # the walk reaches the layers, the head and the tables
    assert {"model.cos", "model.sin", "model.norm"} <= one.keys()
    assert one.keys() == two.keys()
    assert [k for k in one if one[k] != two[k]] == []
