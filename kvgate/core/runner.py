"""The second phase of a step: `ModelRunner.execute(SchedulerOutput) -> ModelOutput`.

Builds the step's tensors (`kvgate.core.step_inputs.build_step`, or a captured CUDA graph's inputs for
a decode-only step that fits one: `build_graph_step`), runs the forward pass, and samples
one token for each row the scheduler named, in one batched call. A forward that raises fails the
step (every row in it, nothing else); a batched sampling call that raises is redone row by row from
the same generator states, so only the row that really fails is failed and its neighbours keep
exactly the draws they would have had.

`forward(output, batch)` is the one call into the model. Tests that need to slow, block or break a
step replace it through `kvgate.core.testing`, so the serving path carries no test hook.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from kvgate.core.outputs import ModelOutput, SchedulerOutput
from kvgate.core.spec_sample import accept_sampled, distributions
from kvgate.core.speculate import accept
from kvgate.core.step_inputs import build_graph_step, build_step
from kvgate.draw_torch import SAMPLE_ROWS
from kvgate.models.decode_graphs import DecodeGraphs, GraphStep
from kvgate.models.llama import StepBatch
from kvgate.sampling import prompt_logprobs, sample_batch


class ModelRunner:
    def __init__(
        self,
        model_forward: Callable[[StepBatch | GraphStep], torch.Tensor],
        *,
        block_size: int,
        attn_token_cap: int,
        device: torch.device,
    ):
        self.model_forward = model_forward
        self.block_size = block_size
        self.attn_token_cap = attn_token_cap
        self.device = device
        # captured decode graphs (kvgate.models.decode_graphs): a decode-only step that fits one of their
        # buckets reaches `model_forward` as a `GraphStep`, not a `StepBatch`; None = every step eager
        self.graphs: DecodeGraphs | None = None

    def forward(self, so: SchedulerOutput, batch: StepBatch | GraphStep) -> torch.Tensor:
        return self.model_forward(batch)

    def execute(self, so: SchedulerOutput) -> ModelOutput:
        t0 = time.monotonic()
        try:
            batch = None
            if self.graphs is not None and not so.prefills and (so.decodes or so.verifies):
                batch, d_rows, v_rows = build_graph_step(so.decodes, so.verifies, self.graphs)
                p_rows = []
            if batch is None:
                batch, d_rows, p_rows, v_rows = build_step(
                    so.decodes,
                    so.prefills,
                    self.block_size,
                    self.attn_token_cap,
                    self.device,
                    so.verifies,
                )
            logits = self.forward(so, batch).cpu()
        except Exception as exc:  # a failed step fails only the rows in it
            return ModelOutput(step_error=f"{type(exc).__name__}: {exc}", seconds=time.monotonic() - t0)
        out = ModelOutput()
        for p, li in zip(so.prefills, p_rows, strict=True):
            if p.score is not None:
                self._score(p, logits, li - len(p.tokens) + 1, out)
        picks = [(d.request_id, li) for d, li in zip(so.decodes, d_rows, strict=True)]
        picks += [  # a row whose scoring failed gets no token: it fails (a token would finish it first)
            (p.request_id, li)
            for p, li in zip(so.prefills, p_rows, strict=True)
            if p.wants_logits and p.request_id not in out.errors
        ]
        if picks:
            self._sample(so, logits, picks, out)
        for v, rows in zip(so.verifies, v_rows, strict=True):
            self._verify(so.samplers[v.request_id], v, logits, rows, out)
        out.seconds = time.monotonic() - t0
        return out

    @staticmethod
    def _score(p, logits: torch.Tensor, first: int, out: ModelOutput) -> None:
        """A scored prompt chunk: each next prompt token's log-probability under the raw logits of the
        position before it (no bias, penalty or grammar: none applies to a prompt), SAMPLE_ROWS rows
        at a time so the temporaries stay within the plan's sampling term."""
        got = []
        try:
            for at in range(0, len(p.score), SAMPLE_ROWS):
                targets = p.score[at : at + SAMPLE_ROWS]
                got += prompt_logprobs(logits[first + at : first + at + len(targets)], targets, p.score_top)
        except Exception as exc:
            out.errors[p.request_id] = f"{type(exc).__name__}: {exc}"
            return
        out.prompt_logprobs[p.request_id] = got

    @staticmethod
    def _verify(sampler, v, logits: torch.Tensor, rows: list[int], out: ModelOutput) -> None:
        """A verify span's tokens. Greedy rows: the model's own choice at each position, kept while
        the drafts agree with it (`speculate.accept`). Sampled rows: the rejection rule on the row's
        distribution at each position (`spec_sample`). Only eligible rows (`speculate.eligible`)
        speculate: no penalties or grammar whose state would move between the positions."""
        rid = v.request_id
        try:
            if sampler.greedy:
                chosen = sample_batch([sampler] * len(rows), logits, rows)
                out.verified[rid] = accept(v.tokens[1:], chosen)
            else:
                out.verified[rid] = accept_sampled(
                    v.tokens[1:], distributions(sampler, logits, rows), sampler.gen
                )
            out.drafted[rid] = len(v.tokens) - 1
        except Exception as exc:
            out.errors[rid] = f"{type(exc).__name__}: {exc}"

    def _sample(self, so: SchedulerOutput, logits: torch.Tensor, picks, out: ModelOutput) -> None:
        samplers = [so.samplers[rid] for rid, _ in picks]
        states = [None if s.greedy else s.gen.get_state() for s in samplers]  # greedy rows never draw
        try:
            tokens = sample_batch(samplers, logits, [li for _, li in picks])
            out.tokens.update((rid, t) for (rid, _), t in zip(picks, tokens, strict=True))
            self._logprobs([(rid, s) for (rid, _), s in zip(picks, samplers, strict=True)], out)
            return
        except Exception:  # find the row that failed: sample each alone (same draws), so it fails alone
            for s, st in zip(samplers, states, strict=True):
                if st is not None:
                    s.gen.set_state(st)
        for (rid, li), s in zip(picks, samplers, strict=True):
            try:
                out.tokens[rid] = s.sample(logits[li])
            except Exception as exc:
                out.errors[rid] = f"{type(exc).__name__}: {exc}"
        self._logprobs([(rid, so.samplers[rid]) for rid, _ in picks if rid in out.tokens], out)

    @staticmethod
    def _logprobs(sampled, out: ModelOutput) -> None:
        """The log-probabilities of the rows that asked (the sampler left them with its last draw)."""
        for rid, s in sampled:
            if s.last_logprobs is not None:
                out.logprobs[rid] = s.last_logprobs
