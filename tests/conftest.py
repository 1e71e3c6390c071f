"""Shared fixtures: a tiny random model on disk, engines built on it, and the cache dir kept per-session.

`KVGATE_TEST_DEVICE` (default cpu) places the fixtures' engines: `bench/cuda_check.sh` runs the
tiny-model modules with it set to cuda on a machine with a GPU. Tests that name a device keep theirs.
Off the CPU a float32 model's KV cache is float16 here, as the CPU's `--kv-dtype auto` makes it, so the
pools the tests size in positions (TINY_KV_BYTES_PER_TOKEN) hold the same number of them.
"""

from __future__ import annotations

import os

import pytest

from tests.tiny_model import make_tiny_hf_dir

TEST_DEVICE = os.environ.get("KVGATE_TEST_DEVICE") or "cpu"


def kv_like_the_cpu(device: str, dtype: str) -> dict:
    """The KV dtype setting that gives an engine off the CPU the cache the CPU's auto gives a float32
    model (float16), so pools sized in positions hold as many; nothing on the CPU or for 16-bit models."""
    return {"kv_dtype": "float16"} if device != "cpu" and dtype == "float32" else {}


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory):
    # Converted-GGUF caches go to a per-session folder unless the caller chose one (CI reuses ~/.cache).
    if "KVGATE_CACHE_DIR" not in os.environ:
        os.environ["KVGATE_CACHE_DIR"] = str(tmp_path_factory.mktemp("kvgate-cache"))


@pytest.fixture(autouse=True)
def _decode_rows_off_the_tiles_after_each_test():
    """A gguf engine's load-time probe (kvgate.models.amx_rows) sets a process-wide switch that sends
    decode calls of many rows to AMX's int8 tiles (the same bits). Back to the default (off) after every
    test, so a later test of the VNNI loop's row groups runs that loop unless it sets the switch itself."""
    yield
    from kvgate.models import native

    ext = native._state.get("module")  # only where a test loaded the kernels: never a build from here
    if ext is not None:
        ext.set_q4_1_amx_rows(0)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return make_tiny_hf_dir(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def make_engine(tiny_dir):
    """Build started engines on the tiny model; every engine is shut down after the test."""
    from kvgate.config import EngineConfig
    from kvgate.core.engine import Engine

    engines = []

    def build(**cfg):
        if "memory_limit" not in cfg and "kv_cache_bytes" not in cfg:
            # The pool is zero-filled real memory: keep test engines small (32k positions of the tiny model).
            cfg["kv_cache_bytes"] = 16 << 20
        cfg.setdefault("memory_limit", "2GiB")
        cfg.setdefault("dtype", "float32")
        cfg.setdefault("device", TEST_DEVICE)
        cfg = {**kv_like_the_cpu(cfg["device"], cfg["dtype"]), **cfg}
        overhead = cfg.pop("overhead_bytes", 0)
        e = Engine.from_model(str(tiny_dir), EngineConfig(**cfg), overhead_bytes=overhead).start()
        engines.append(e)
        return e

    yield build
    for e in engines:
        e.shutdown()


@pytest.fixture(scope="module")
def tiny_base(tiny_dir):
    """A server on the tiny model (float32, 16 MiB of KV), one per test module: its base URL."""
    from kvgate.config import EngineConfig
    from kvgate.core.engine import Engine
    from tests.server_util import running_server

    cfg = EngineConfig(
        kv_cache_bytes=16 << 20,
        memory_limit="2GiB",
        dtype="float32",
        device=TEST_DEVICE,
        **kv_like_the_cpu(TEST_DEVICE, "float32"),
    )
    e = Engine.from_model(str(tiny_dir), cfg, overhead_bytes=0).start()
    with running_server(e) as (b, _app):
        yield b
    e.shutdown()


@pytest.fixture(scope="module")
def real_base():
    """A server on the real SmolLM2 (2 GiB, 2k context), one per test module: its base URL."""
    from kvgate.config import EngineConfig
    from kvgate.core.engine import Engine
    from tests.server_util import running_server

    engine = Engine.from_model("default", EngineConfig(memory_limit="2GiB", max_model_len=2048)).start()
    with running_server(engine, model_name="SmolLM2-135M-Instruct") as (b, _app):
        yield b
    engine.shutdown()


@pytest.fixture(scope="module")
def op():
    """The paged decode attention kernel, or a skip saying why it is not here."""
    from kvgate.models.paged_attention import kernel

    k = kernel()
    if k is None:
        pytest.skip("the paged attention extension could not be built here (see the kvgate.models log line)")
    return k
