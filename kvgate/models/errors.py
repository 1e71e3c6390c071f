"""Load-time errors. Each message says what failed, why, and what to do next."""

from __future__ import annotations


class ModelLoadError(Exception):
    """A model could not be loaded; the message is meant for the person who asked for it."""


SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "smollm", "gemma3")
