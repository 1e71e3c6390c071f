"""Plain values that cross module boundaries: the model's geometry and the engine's limits.

Nothing here allocates or decides; loaders fill `ModelSpec`, the CLI and server fill `EngineConfig`,
and the memory planner (`kvgate.memory.plan`) turns both into a byte plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True, frozen=True)
class ModelSpec:
    """Geometry of a Llama-family decoder, as read from a GGUF file or an HF `config.json`."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    name: str = "model"

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V, every layer: 2 x layers x kv_heads x head_dim x bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


@dataclass(slots=True)
class EngineConfig:
    """Every knob of the engine; the CLI exposes each as a flag and a KVGATE_* environment variable."""

    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto | bfloat16 | float16 | float32
    memory_limit: str = "auto"  # bytes ("4GiB"), fraction of device memory ("0.5"), or "auto"
    kv_cache_bytes: int | None = None  # explicit KV pool size; None = whatever the limit leaves
    block_size: int = 16
    max_seqs: int = 32  # running rows, prompts still prefilling included
    max_queue: int = 256
    max_queue_wait: float = 30.0  # seconds a request may wait for KV before a 429; 0 = refuse at once
    max_ttft: float | None = None  # refuse (429) at arrival when the predicted time to first token exceeds it
    prefill_chunk: int = 256
    min_cap_tokens: int = 256
    max_model_len: int | None = None  # None = the model's own context length
    seed: int | None = None  # default seed for requests that give none (None = fresh entropy)
    threads: int | None = None  # torch intra-op threads; None = torch's default
    pack_weights: str = "auto"  # auto | on | off: oneDNN-prepacked weight matrices (CPU float32)
    extra: dict = field(default_factory=dict)
