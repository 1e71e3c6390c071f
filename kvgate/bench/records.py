"""What one benchmark request is and what was measured about it.

`Prompt` is a request to send (text or chat messages, its token count when known, an optional
per-request output length); `RequestRecord` is what came back (HTTP status, refusal details,
TTFT / ITL / E2E in milliseconds, token counts). `record_json` is a record as the JSON report stores
it, with the derived TPOT included. Plain data: no I/O, no imports from the rest of `kvgate.bench`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class Prompt:
    text: str | None = None
    messages: list | None = None
    prompt_tokens: int | None = None  # as counted when built (None: unknown)
    output_len: int | None = None
    prompt_ids: list[int] | None = None

    def to_json(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass
class RequestRecord:
    index: int
    sent_at: float  # seconds since the run started
    status: int = 0  # HTTP status; 0 = no response (connection error or timeout)
    ok: bool = False  # 200 and a complete stream (finish_reason seen, no error event)
    error: str | None = None
    error_code: str | None = None
    retry_after: str | None = None
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    itl_ms: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int | None = None
    tokens_from_usage: bool = False
    finish_reason: str | None = None
    requested_output: int | None = None

    @property
    def tpot_ms(self) -> float | None:
        if self.ok and self.output_tokens > 1 and self.ttft_ms is not None and self.e2e_ms is not None:
            return (self.e2e_ms - self.ttft_ms) / (self.output_tokens - 1)
        return None


def record_json(r: RequestRecord) -> dict:
    d = asdict(r)
    d["tpot_ms"] = r.tpot_ms
    return d
