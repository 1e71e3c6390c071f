"""`--kv-dtype`: which dtype the KV pool holds, and the plan's note on it (what a position costs in
it: `kvgate.models.kv_int8.element_bytes`).

auto is float16 under a float32 model on a CPU whose paged kernel built (llama.cpp's default f16 cache);
float32, float16 and bfloat16 name the pool's dtype; int8 is codes with a float32 step and offset per
position and KV head (`kvgate.models.kv_int8`), 56% of a float16 pool's bytes for a head of 64, on a CPU
under a float32 model (the C++ kernels write and read it; without them, PyTorch's glue and gather paths).
"""

from __future__ import annotations

import torch

from kvgate.core.device_error import DeviceError
from kvgate.models.kv_int8 import is_int8
from kvgate.models.paged_attention import kernel as paged_attention_kernel

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_kv_dtype(
    name: str,
    dtype: torch.dtype,
    device: torch.device,
    paged_kernel: bool | None = None,
    auto_dtype: bool = False,
) -> torch.dtype:
    """auto: float16 under a float32 model on a CPU whose paged attention kernel built (llama.cpp's
    default f16 cache: half the bytes a token, twice the positions in the same memory, half the decode
    attention's reads; logprobs move ~1e-3, docs/DESIGN_NOTES.md), else the model's dtype (without the
    kernel every step would gather and widen the narrow pool). Else the named one, when it is the
    model's or a 16-bit cache under a float32 model (what the K/V write, the paged kernel and the gather
    paths convert), or int8 codes with a step and offset per position and KV head
    (`kvgate.models.kv_int8`: 56% of a float16 cache's bytes for a head of 64) under a float32 model on
    a CPU. `paged_kernel`: whether the kernel is there (None: look). `auto_dtype`: `--dtype auto` chose
    the model's dtype (a refusal says so: the user never named it)."""
    if name == "auto":
        if device.type != "cpu" or dtype != torch.float32:
            return dtype
        if paged_kernel is None:
            paged_kernel = paged_attention_kernel() is not None
        return torch.float16 if paged_kernel else dtype
    if name == "int8":
        if device.type != "cpu" or dtype != torch.float32:
            model = str(dtype).removeprefix("torch.")
            other = "auto or float16" if dtype == torch.float32 else f"auto ({model})"
            chose = " (--dtype auto chose it)" if auto_dtype else ""
            raise DeviceError(
                f"--kv-dtype int8 is written and read by kvgate's CPU kernels under a float32 model; this is "
                f"a {model} model{chose} on {device}. Use --kv-dtype {other} here"
                + (" (or --dtype float32 to allow int8)." if device.type == "cpu" else ".")
            )
        return torch.int8
    if name not in _DTYPES:
        raise DeviceError(f"--kv-dtype {name!r} is not one of auto, {', '.join(_DTYPES)}, int8")
    kv = _DTYPES[name]
    if kv != dtype and dtype != torch.float32:
        model = str(dtype).removeprefix("torch.")
        chose = " (--dtype auto chose it)" if auto_dtype else ""
        raise DeviceError(
            f"--kv-dtype {name} under a {model} model{chose}: a KV cache other than the model's dtype must be a "
            f"16-bit one under a float32 model. Use --kv-dtype auto ({model}), or --dtype float32."
        )
    return kv


def kv_note(kv_dtype: torch.dtype, setting: str, model_dtype: str) -> str:
    """The plan's note for a pool whose dtype is not the model's."""
    if is_int8(kv_dtype):
        return (
            f"KV cache in int8 codes with a float32 step and offset per position and KV head (--kv-dtype "
            f"int8), the model in {model_dtype}"
        )
    source = (
        "--kv-dtype auto on a CPU, as llama.cpp's f16 cache; --kv-dtype float32 keeps the model's"
        if setting == "auto"
        else "--kv-dtype"
    )
    return f"KV cache in {str(kv_dtype).removeprefix('torch.')} ({source}), the model in {model_dtype}"
