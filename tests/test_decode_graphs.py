"""CUDA decode graphs without a GPU: the buckets, what the plan charges for them, the padded static
inputs, and engines whose decode steps go through those static batches run eagerly
(`kvgate.core.testing.static_decode`), against engines that build every step as before. What only a GPU
can show (a replay equals the eager forward, the measured pool within its charge) is in tests/test_cuda.py.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kvgate.core.testing import static_decode
from kvgate.memory.graphs import block_buckets, graph_bytes, graph_shapes, input_values, row_buckets
from kvgate.request import Finished, GenerationRequest, Token
from kvgate.sampling import SamplingParams
from tests.test_plan import SMOLLM2, smollm2_plan
from tests.test_speculate import PROMPTS as SPEC_PROMPTS  # prompts whose greedy outputs repeat them

PROMPTS = [[3 + (i * 37 + s * 101) % 256 for i in range(n)] for s, n in enumerate((1, 7, 19, 40, 130))]


def test_buckets_round_every_step_up_within_the_attention_cap():
    """Every decode step of up to the plan's rows and context maps to the smallest captured bucket pair
    at least its size when that pair's padded attention fits the cap, and to none otherwise (it then
    runs eagerly); no captured pair exceeds the cap."""
    assert row_buckets(32) == [1, 2, 4, 8, 16, 24, 32]
    assert row_buckets(100) == [1, 2, 4, 8, 16, 24, 32, 48, 72, 100]
    assert block_buckets(512) == [8, 16, 32, 64, 128, 256, 512] and block_buckets(5) == [5]
    plan = smollm2_plan(limit="8GiB", cuda_graphs=True, max_seqs=8, max_model_len=2048)
    L, bs = plan.limits, plan.block_size
    shapes = graph_shapes(L, bs)
    assert plan.graph_shapes == len(shapes) and all(r * b * bs <= L.attn_token_cap for r, b in shapes)
    from kvgate.models.decode_graphs import DecodeGraphs

    g = DecodeGraphs.__new__(DecodeGraphs)  # the host-side lookup only: no model, no buffers
    g.shapes, g.row_sizes, g.block_sizes = (
        set(shapes),
        sorted({r for r, _ in shapes}),
        sorted({b for _, b in shapes}),
    )
    # by hand: the cap is min(8 x 2048, max(2048, 8 x 512)) = 4096 positions, 256 block-rows
    assert L.attn_token_cap == 4096 and g.row_sizes == [1, 2, 4, 8] and g.block_sizes == [8, 16, 32, 64, 128]
    assert g.shape_for(3, 9) == (4, 16) and g.shape_for(1, 128) == (1, 128) and g.shape_for(4, 64) == (4, 64)
    assert g.shape_for(8, 40) is None and g.shape_for(5, 33) is None  # (8, 64): 512 block-rows
    for rows in range(1, L.max_logit_rows + 1):
        for blocks in range(1, 2048 // bs + 1):
            want = (min(r for r in g.row_sizes if r >= rows), min(b for b in g.block_sizes if b >= blocks))
            fits = want[0] * want[1] * bs <= L.attn_token_cap
            assert g.shape_for(rows, blocks) == (want if fits else None), (rows, blocks)


def test_the_plan_charges_the_graphs_before_the_kv_pool():
    """With graphs the plan's pool shrinks by exactly their bytes (pool estimate, static buffers, the pad
    block), each named in `describe`; without, nothing is charged."""
    off = smollm2_plan(limit="8GiB")
    on = smollm2_plan(limit="8GiB", cuda_graphs=True)
    parts = on.graph_breakdown
    block = on.block_size * on.kv_bytes_per_token
    assert off.graph_bytes == 0 and off.graph_breakdown is None
    assert on.graph_bytes == sum(parts.values()) and parts["pad_block"] == block
    assert parts == graph_bytes(SMOLLM2, 2, on.limits, on.block_size, block)
    shapes = graph_shapes(on.limits, on.block_size)
    assert (
        parts["buffers"] == max(input_values(*s) for s in shapes) * 8 + 32 * 8 + 32 * SMOLLM2.vocab_size * 4
    )
    assert off.kv_blocks - on.kv_blocks == -(-on.graph_bytes // block) or (
        off.kv_blocks - on.kv_blocks == on.graph_bytes // block
    )
    assert "CUDA graphs" in on.describe() and "CUDA graphs" not in off.describe()
    full = smollm2_plan(limit="8GiB", cuda_graphs=True, step_pieces=True)
    g = full.graph_breakdown
    T = full.limits.max_step_tokens
    assert g["pieces_buffers"] == T * 24 + T * (SMOLLM2.hidden_size + 2 * SMOLLM2.q_size) * 2
    assert full.graph_bytes == sum(g.values()) == on.graph_bytes + g["pieces_pool"] + g["pieces_buffers"]
    assert full.kv_blocks < on.kv_blocks and "step pieces" in full.describe()


def test_a_steps_static_inputs_pad_to_the_bucket_with_the_pad_block(make_engine):
    """Three rows in the (4, 8) bucket: real rows' slots and tables are theirs, padded with the pad
    block; the padding row is token 0 at position 0, context 1, writing and reading the pad block only.
    Seen red with the padding row's slot at block 0 (a block a request holds)."""
    e = make_engine(max_seqs=4)
    g = static_decode(e)
    pad, bs = g.pad_block, g.block_size
    step = g.step([5, 6, 7], [40, 3, 17], [[9, 10, 11, 12], [4], [2, 8, 30]])
    assert step.shape == (4, 8) and step.rows == 3 and len(step.values) == input_values(4, 8)
    v = step.values
    ids, pos, slots, lens, table = v[0:4], v[4:8], v[8:12], v[12:16], v[16:]
    assert ids == [5, 6, 7, 0] and pos == [40, 3, 17, 0] and lens == [41, 4, 18, 1]
    assert slots == [11 * bs + 40 % bs, 4 * bs + 3, 8 * bs + 1, pad * bs]
    assert table == [9, 10, 11] + [pad] * 5 + [4] + [pad] * 7 + [2, 8] + [pad] * 6 + [pad] * 8


def generate(e, prompts, sp, n=24, logprobs=True) -> list[tuple[list[int], list[float]]]:
    """Each prompt's tokens and their logprobs, all submitted before any is read (so they batch); prompt
    i asks for n - 4i tokens, so the batch shrinks row by row. A row asking for logprobs never
    speculates (`kvgate.core.speculate.eligible`)."""
    sp = replace(sp, logprobs=0 if logprobs else None)
    handles = [
        e.submit(GenerationRequest(list(p), sp, n - 4 * i, [], ignore_eos=True))
        for i, p in enumerate(prompts)
    ]
    out = []
    for h in handles:
        events = list(h)
        assert isinstance(events[-1], Finished)
        lps = [ev.logprobs.logprob for ev in events if isinstance(ev, Token) and ev.logprobs]
        out.append((events[-1].result.token_ids, lps))
    return out


def count_eager_decodes(e) -> list:
    """A list that grows by one for each decode-only step the engine's model runs eagerly."""
    seen, forward = [], e.model.forward

    def spy(batch, kv):
        if not batch.prefills:
            seen.append(1)
        return forward(batch, kv)

    e.model.forward = spy
    return seen


def torch_glue(e):
    """The CUDA path's layer code on a CPU engine: PyTorch ops between the matmuls, no C++ decode stack."""
    e.model.layer_ops = None
    e.model.decode_stack = None
    return e


@pytest.mark.parametrize("attention,glue", [("gather", "torch"), ("gather", "cpu"), ("auto", "cpu")])
def test_static_decode_generates_what_the_eager_engine_does(make_engine, attention, glue):
    """Greedy and seeded sampling through the padded static batches give the eager engine's tokens for
    five prompts batched (3-5 rows pad to buckets of 4 and 8), with logprobs within float32 noise, and
    a step no bucket holds (the restricted shapes leave 5+ rows out) runs eagerly in the same engine.
    Seen red (tokens differ) with the padding rows' K/V written to block 0, where a request's prompt
    is, and with every real row's context length one position too long."""
    prep = torch_glue if glue == "torch" else (lambda e: e)
    for sp in (SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_p=0.9, seed=3)):
        plain = generate(prep(make_engine(max_seqs=8, decode_attention=attention)), PROMPTS, sp)
        e = prep(make_engine(max_seqs=8, decode_attention=attention))
        g = static_decode(e, [(r, b) for r in (1, 2, 4) for b in (8, 16, 32)])
        eager_decodes = count_eager_decodes(e)
        got = generate(e, PROMPTS, sp)
        assert g.replays > 0 and eager_decodes  # 5 rows: no bucket; 4 and fewer: replayed
        assert [t for t, _ in got] == [t for t, _ in plain]
        for (_, a), (_, b) in zip(got, plain, strict=True):
            assert len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-4


def test_speculation_verifies_through_the_static_batches(make_engine):
    """Verify spans run as decode rows of the graphs' buckets: with 3 drafts per step the greedy tokens
    equal those of plain decoding, and drafts were accepted."""
    sp = SamplingParams(temperature=0.0)
    plain = generate(make_engine(max_seqs=4), SPEC_PROMPTS, sp, n=40, logprobs=False)
    e = make_engine(max_seqs=4, speculate=3)
    g = static_decode(e)
    got = generate(e, SPEC_PROMPTS, sp, n=40, logprobs=False)
    assert [t for t, _ in got] == [t for t, _ in plain]
    assert g.replays > 0 and e.core.state.counters.spec_accepted_tokens > 0


def test_without_capture_the_buffers_are_not_handed_out(make_engine):
    """Two steps' logits from the static path are separate tensors: the runner may keep the first while
    the second runs (on a CPU the output buffer itself would be overwritten)."""
    e = make_engine(max_seqs=2)
    g = static_decode(e)
    a = g.step([5], [3], [[1]])
    first = g.run(a)
    kept = first.clone()
    g.run(g.step([9], [4], [[1]]))
    assert torch.equal(first, kept)


def test_the_server_reports_graph_replays_and_the_capture(make_engine):
    """/metrics counts replayed decode steps and gives the measured pool; /v1/resources says what the
    capture did. Seen red with the counter fed the replays' seconds instead of their count."""
    import httpx

    from tests.server_util import running_server

    e = make_engine(max_seqs=4)
    g = static_decode(e)
    e.graphs_note = "decode graphs: static, run eagerly (test)"
    with running_server(e) as (base, _app):
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 6, "ignore_eos": True}
        assert httpx.post(base + "/v1/completions", json=body, timeout=60).status_code == 200
        metrics = httpx.get(base + "/metrics", timeout=10).text
        resources = httpx.get(base + "/v1/resources", timeout=10).json()
    replays = [ln for ln in metrics.splitlines() if ln.startswith("kvgate_cuda_graph_replays_total")]
    assert replays and float(replays[0].split()[-1]) == g.replays >= 5
    assert "kvgate_cuda_graph_pool_bytes 0.0" in metrics
    assert resources["scheduler"]["cuda_graphs"] == e.graphs_note


# ---- step pieces (--cuda-graphs full): steps with prompt chunks, the glue replayed, attention eager ----
def test_token_buckets_end_at_the_steps_most_tokens():
    from kvgate.memory.graphs import token_buckets

    assert token_buckets(288) == [16, 32, 64, 128, 256, 288] and token_buckets(10) == [10]


@pytest.mark.parametrize("layer_ops", [False, True])
def test_step_pieces_generate_what_the_eager_engine_does(make_engine, layer_ops):
    """Prompts prefilled in 32-token chunks beside decoding rows, through the pieces (the step's tokens
    padded to a bucket, each layer's glue from the static buffers, its attention eager between), give
    the plain engine's greedy and seeded tokens, logprobs within float32 noise and the same prompt
    logprobs; with decode graphs too, decode-only steps replay those. Compared against the PyTorch glue
    (layer_ops False, the CUDA path's ops) and against the CPU's C++ glue (an RMSNorm an ulp apart).
    Seen red with the padding tokens' slots left at the step's last real slot (they overwrite its K/V)
    and with the pieces handing layer l's q to layer l+1's attention."""
    from kvgate.core.testing import static_pieces

    def engine(pieces: bool):
        e = make_engine(max_seqs=8, prefill_chunk=32)
        if not layer_ops:
            e.model.layer_ops = None
        if pieces:
            static_pieces(e)
            static_decode(e)
        return e

    for sp in (SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_p=0.9, seed=5)):
        plain = generate(engine(False), PROMPTS, sp)
        e = engine(True)
        got = generate(e, PROMPTS, sp)
        assert e.pieces.replays > 0 and e.runner.graphs.replays > 0
        assert [t for t, _ in got] == [t for t, _ in plain]
        for (_, a), (_, b) in zip(got, plain, strict=True):
            assert len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-4
    scored = []
    for pieces in (False, True):
        e = engine(pieces)
        req = GenerationRequest(list(PROMPTS[4]), SamplingParams(temperature=0.0), 4, [], prompt_logprobs=1)
        scored.append([lp.logprob for lp in e.submit(req).result(60).prompt_logprobs])
    assert len(scored[0]) == len(PROMPTS[4]) - 1
    assert max(abs(x - y) for x, y in zip(*scored, strict=True)) < 1e-4


def test_a_failed_capture_falls_back_under_auto_and_is_an_error_otherwise(make_engine, monkeypatch):
    """`--cuda-graphs auto`: a capture that raises, or a pool measured over its charge, leaves decode steps
    eager, says why, and gives the charge back to the ledger but for the pad block; `on` and `full` refuse
    to start, naming the failure and the way out. Seen red with `full` falling back silently."""
    from kvgate.memory.plan import PlanError
    from kvgate.models.decode_graphs import DecodeGraphs

    def raising(self):
        raise RuntimeError("no capture here")

    def over(self):
        self.pool_bytes = 101
        return "captured"

    for capture, why in ((raising, "no capture here"), (over, "the plan charged 100")):
        monkeypatch.setattr(DecodeGraphs, "capture_all", capture)
        e = make_engine(max_seqs=4)
        e.plan.graph_breakdown = {"pool": 100, "buffers": 10, "pad_block": 7}
        e.graph_reservation = e.ledger.reserve("cuda_graphs", 117, "test: what the plan charged")
        for setting in ("on", "full"):
            with pytest.raises(PlanError, match=f"--cuda-graphs {setting}: capturing .*{why}.*auto"):
                e._capture_graphs(setting)
        assert e.ledger.by_role()["cuda_graphs"] == 117
        e._capture_graphs("auto")
        assert e.runner.graphs is None and why in e.graphs_note and "eagerly" in e.graphs_note
        assert e.ledger.by_role()["cuda_graphs"] == 7


def test_a_failed_pieces_capture_is_an_error_that_releases_the_decode_graphs(make_engine, monkeypatch):
    """`--cuda-graphs full` insists: a pieces capture that raises, or a pool over its charge, refuses to
    start with the cause and the way out, and the decode graphs already captured are released. A step
    over the largest token bucket is an error naming both numbers, not a TypeError. Seen red with the
    capture's exception passing through unwrapped (the graphs kept), with the pieces' release left out,
    and with the bucket check left out (a TypeError)."""
    from kvgate.core.testing import static_pieces
    from kvgate.memory.plan import PlanError
    from kvgate.models.step_pieces import StepPieces

    def raising(self):
        raise RuntimeError("capture invalidated")

    def over(self):
        self.pool_bytes = 101
        return "captured"

    released = []
    monkeypatch.setattr(StepPieces, "release", lambda self: released.append(self))
    for capture, why in ((raising, "capture invalidated"), (over, "plan charged 100")):
        monkeypatch.setattr(StepPieces, "capture_all", capture)
        e = make_engine(max_seqs=4)
        e.plan.graph_breakdown = {"pieces_pool": 100}
        graphs = static_decode(e)
        released.clear()
        with pytest.raises(
            PlanError, match=f"--cuda-graphs full: capturing the step pieces failed .*{why}.*on"
        ):
            e._capture_pieces()
        assert not graphs.shapes and e.pieces is None and len(released) == 1
    monkeypatch.undo()
    e = make_engine(max_seqs=4, prefill_chunk=32)
    pieces = static_pieces(e)
    pieces.buckets = pieces.buckets[:1]  # 16 tokens: the 20-token prompt below is over it
    req = GenerationRequest(list(PROMPTS[4][:20]), SamplingParams(temperature=0.0), 2, [])
    res = e.submit(req).result(60)
    assert res.finish_reason == "error" and "a step of 20 tokens is over the largest bucket, 16" in res.error


def test_a_piece_that_raises_mid_capture_still_ends_its_capture(make_engine, monkeypatch):
    """The GPU path on CPU stand-ins (a reviewer's): every capture_begin meets a capture_end even when the
    piece raises (an open capture on the shared side stream would fail every later capture in the
    process), and the piece's own error surfaces, not capture_end's. Seen red with the capture_end
    after the piece unguarded (no end, ["begin", "end", "begin"])."""
    import contextlib

    from kvgate.core.testing import static_pieces
    from kvgate.models.step_pieces import StepPieces

    pieces = static_pieces(make_engine(max_seqs=4))
    pieces.buckets = pieces.buckets[:1]
    calls = []

    class FakeGraph:
        def capture_begin(self, pool=None):
            calls.append("begin")

        def capture_end(self):
            calls.append("end")
            if len(calls) > 2:  # an invalidated capture: its end raises too
                raise RuntimeError("capture_end on an invalidated capture")

    class FakeStream:
        def wait_stream(self, other):
            pass

    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: FakeStream())
    real = StepPieces._piece

    def piece(self, tb, li):
        if calls and li == 1:  # inside the second capture
            raise RuntimeError("the piece failed")
        return real(self, tb, li)

    monkeypatch.setattr(StepPieces, "_piece", piece)
    with pytest.raises(RuntimeError, match="the piece failed"):
        pieces._capture_each(None, FakeStream())
    assert calls == ["begin", "end", "begin", "end"]


def test_the_setting_is_checked_against_the_device():
    from kvgate.core.placement import DeviceError, resolve_cuda_graphs

    cpu = torch.device("cpu")
    assert resolve_cuda_graphs("auto", cpu) == (False, False) == resolve_cuda_graphs("off", cpu)
    for bad, msg in (("on", "needs a CUDA device"), ("full", "needs a CUDA device"), ("yes", "not one of")):
        with pytest.raises(DeviceError, match=msg):
            resolve_cuda_graphs(bad, cpu)
