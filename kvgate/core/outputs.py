"""The typed hand-offs between the three phases of one engine step.

    schedule() -> SchedulerOutput -> ModelRunner.execute() -> ModelOutput -> update()

`SchedulerOutput` says who runs this step and how: the decode rows (one token each), the prompt
chunks, their block tables, and the samplers of the rows that get a token. `ModelOutput` says what
came back: a token per sampled row, a reason per row whose sampling failed, or one reason for the
whole step when the forward pass failed. Neither holds a reference to the scheduler's rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvgate.core.step_inputs import DecodeInput, PrefillInput, VerifyInput
from kvgate.sampling import Sampler, TokenLogprobs


@dataclass
class SchedulerOutput:
    decodes: list[DecodeInput] = field(default_factory=list)
    prefills: list[PrefillInput] = field(default_factory=list)
    verifies: list[VerifyInput] = field(default_factory=list)  # decoding rows with draft tokens
    # rows that get a token this step (decodes, and prefills whose chunk ends the prompt), by id
    samplers: dict[int, Sampler] = field(default_factory=dict)
    admitted: list[int] = field(default_factory=list)  # admitted at this tick (informational)

    @property
    def request_ids(self) -> list[int]:
        return [x.request_id for x in (*self.decodes, *self.prefills, *self.verifies)]

    @property
    def empty(self) -> bool:
        return not self.decodes and not self.prefills and not self.verifies


@dataclass
class ModelOutput:
    tokens: dict[int, int] = field(default_factory=dict)  # request id -> sampled token
    # verify spans: request id -> the tokens to append in order, and how many drafts it had
    verified: dict[int, list[int]] = field(default_factory=dict)
    drafted: dict[int, int] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)  # request id -> why its sampling failed
    logprobs: dict[int, TokenLogprobs] = field(default_factory=dict)  # rows that asked for them
    # scored prompt chunks: request id -> its next prompt tokens' log-probabilities, in order
    prompt_logprobs: dict[int, list[TokenLogprobs]] = field(default_factory=dict)
    step_error: str | None = None  # the forward failed: every row in the step fails with this
    seconds: float = 0.0  # wall time of the forward and sampling
