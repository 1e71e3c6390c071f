"""The third phase of a step: apply a `ModelOutput` to the rows that ran.

Prompt chunks advance their row's computed positions; each sampled token is appended, checked
against the stop ids and strings, detokenized and sent as a `Token` event; a row that is done leaves
through `EngineState.finish` (also when its grammar is complete: nothing else may follow). A token's
log-probabilities, when its row asked for them, ride on its `Token` event. A verified draft span
(`--speculate`) appends its tokens in order and tells the row's draft gate how many of its drafts
were kept (`speculate.DraftGate`: whether the row drafts next). A failed forward fails
every row of the step; a failure while handling one row's token (a detokenizer or stop matcher that
raises) fails that row alone.
"""

from __future__ import annotations

import logging
import time

from kvgate.core.outputs import ModelOutput, SchedulerOutput
from kvgate.core.rows import Row
from kvgate.core.state import EngineState
from kvgate.request import Token

log = logging.getLogger("kvgate.engine")


class Updater:
    def __init__(self, state: EngineState, max_model_len: int, prefill_chunk: int):
        self.state = state
        self.max_model_len = max_model_len
        self.prefill_chunk = prefill_chunk

    def update(self, so: SchedulerOutput, mo: ModelOutput) -> None:
        s = self.state
        c = s.counters
        if mo.step_error is not None:
            rows = [s.running[rid] for rid in so.request_ids if rid in s.running]
            c.failed += len(rows)
            for row in rows:
                s.finish(row, "error", error=mo.step_error)
            return
        prefilled = sum(len(p.tokens) for p in so.prefills)
        # the prefilled tokens' mean position: a chunk deep in a long prompt costs more per token
        position = sum(len(p.tokens) * (p.start + len(p.tokens) / 2) for p in so.prefills) / max(1, prefilled)
        alone = not (so.decodes or so.verifies)
        s.times.observe(mo.seconds, prefilled, self.prefill_chunk, alone=alone, position=position)
        c.steps += 1
        if so.decodes or so.verifies:
            c.decode_steps += 1
            c.decode_tokens += len(so.decodes)
        c.prefill_chunks += len(so.prefills)
        c.prefill_tokens += prefilled
        for p in so.prefills:
            row = s.running.get(p.request_id)
            if row is not None:
                row.computed += len(p.tokens)
                if p.request_id in mo.prompt_logprobs:
                    row.prompt_logprobs.extend(mo.prompt_logprobs[p.request_id])
                s.kv.commit(row.id, row.computed)  # full prompt blocks computed: now shareable
        now = time.monotonic()
        # a sampled row brings one token; a verified draft span (--speculate) several, kept in order
        runs = [(rid, [token], mo.logprobs.get(rid)) for rid, token in mo.tokens.items()]
        runs += [(rid, tokens, None) for rid, tokens in mo.verified.items()]
        for rid, tokens, logprobs in runs:
            row = s.running.get(rid)
            if row is None:
                continue
            if rid in mo.verified:
                c.decode_tokens += 1
                c.spec_draft_tokens += mo.drafted.get(rid, 0)
                if row.prediction is not None:  # before the tokens: the row may finish among them
                    row.prediction.observe(len(tokens) - 1)
            try:
                for i, token in enumerate(tokens):  # until the row ends (a stop token or string, its length)
                    self._append(row, token, now, logprobs)
                    c.spec_accepted_tokens += (
                        i > 0
                    )  # a draft the row kept (the first token is the step's own)
                    if rid not in s.running:
                        break
                if rid in mo.verified and row.gate is not None:  # whether it drafts next (its own history)
                    row.gate.observe(mo.drafted.get(rid, 0), len(tokens) - 1, len(row.tokens))
            except Exception as exc:
                log.exception("handling a token of request %d failed", rid)
                c.failed += 1
                s.finish(row, "error", error=f"{type(exc).__name__}: {exc}", flush=False)
        for rid, error in mo.errors.items():
            row = s.running.get(rid)
            if row is not None:
                c.failed += 1
                s.finish(row, "error", error=error, flush=False)

    def _append(self, row: Row, token: int, now: float, logprobs=None) -> None:
        s = self.state
        row.computed = len(row.tokens)
        row.tokens.append(token)
        row.token_times.append(now)
        s.counters.generated_tokens += 1
        if row.stop.is_stop_token(token):
            req = row.handle.request
            # vLLM's include_stop_str_in_output: the stop token's own text is output too, and a stop
            # string completed by it (or held back before it) still counts; with report_stop_token the
            # token is an event of its own (its logprobs), carrying the held-back tail
            if req.include_stop_str or req.report_stop_token:
                own = row.detok.push(token) if req.include_stop_str else ""
                emit, hit = row.stop.push(own + row.detok.flush(), final=True)
                emit += "" if hit else row.stop.flush()
                if emit:
                    row.text.append(emit)
                s.emit(row.handle, Token(token, emit, now, logprobs, after_text=not req.include_stop_str))
                s.finish(row, "stop", stop_reason="string" if hit else f"token:{token}", flush=False)
                return
            s.finish(row, "stop", stop_reason=f"token:{token}")
            return
        # vLLM's min_tokens: no stop string counts until more than that many tokens are out
        out = len(row.tokens) - len(row.prompt)
        emit, hit = row.stop.push(row.detok.push(token), match=out > row.sampler.min_tokens)
        if emit:
            row.text.append(emit)
        s.emit(row.handle, Token(token, emit, now, logprobs))
        if hit:
            s.finish(row, "stop", stop_reason="string", flush=False)
        elif row.sampler.grammar_done:  # the grammar is complete: nothing else may follow
            s.finish(row, "stop", stop_reason="grammar")
        elif len(row.out_ids) >= row.max_tokens or len(row.tokens) >= self.max_model_len:
            s.finish(row, "length")
