#!/usr/bin/env bash
# The CUDA checks a session lent a GPU runs there, in one call of the device tool (CI has no GPU).
#
#   here:  bash bench/cuda_check.sh prepare   # .gpu/smol (SmolLM2's config + tokenizer) and .whl (the
#                                             # cp312 wheels the GPU machine lacks, at .venv's versions)
#   there: bash bench/cuda_check.sh           # (carry .whl and .gpu; results land in $OUT)
#
# 1. the CUDA tests, and the tiny-model modules with their engines on the GPU (KVGATE_TEST_DEVICE);
#    (kvgate's C++ kernels are built first, on their own: the CUDA engine's host-side draw uses them);
# 2. a SmolLM2-shaped stand-in (bench/shape_model.py) served on the GPU and driven by `kvgate bench`
#    at c=1, 16 and 64 (256 tokens in, 128 out), with --cuda-graphs full, on and off (SERVE_GRAPHS; ~65 s
#    each in session 27); SERVE_FLAGS adds server flags (e.g. "--prefill-chunk 1024": c=64's TTFT was 2.6 s
#    with 256-token chunks, and on a launch-bound GPU a bigger chunk costs a step little);
# 3. its decode step's wall time at 1, 16 and 64 rows (bench/profile_step.py);
# 4. its engine step with the decode graphs on and off, split into forward, sampling and the rest, and
#    the graph step's Python profile (bench/cuda_graph_probe.py).
# PARTS="tests serve step graph" (the default) picks which run; DEVICE=cpu runs them here, as a dry run of the
# script itself. The parts' timeouts add up to more than one device call's 600 s (tests 330, serve
# 60 + 110, step 90, graph 120, the kernels' build up to 400 the first time): in session 26 they took
# ~100, ~90, ~60 and ~100 s and the build was not yet separate, so give a call two or three parts.
set -u
WHEELS="fastapi starlette uvicorn pydantic pydantic_core annotated-types typing-inspection opentelemetry-api gguf
llguidance openai httpx2 httpcore2 truststore distro jiter sniffio typing_extensions jsonschema referencing
jsonschema-specifications rpds-py ninja"
if [ "${1:-}" = prepare ]; then  # here, in the repo's root, before the device call
  set -o pipefail
  exclude=$(git rev-parse --git-path info/exclude) || exit 1
  mkdir -p "$(dirname "$exclude")"
  for d in /.whl/ /.gpu/; do  # both stay out of git, and travel only where `carry` names them
    grep -qx "$d" "$exclude" 2>/dev/null || printf '\n%s\n' "$d" >>"$exclude"
  done
  rm -rf .whl .gpu  # one version of each wheel (two stop the install there), no old 270 MB weights
  .venv/bin/python -m bench.shape_model export .gpu/smol || exit 1
  for p in $WHEELS; do
    v=$(.venv/bin/python -m pip show "$p" 2>/dev/null | awk '/^Version:/ {print $2}')
    [ -n "$v" ] || { echo "not in .venv: $p"; exit 1; }
    .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 \
      -d .whl "$p==$v" 2>&1 | { grep -v WARNING || true; } || { echo "no cp312 wheel of $p==$v"; exit 1; }
  done
  du -sh .whl .gpu
  exit 0
fi
OUT=${OUT:-/tmp/cuda_check}
DEVICE=${DEVICE:-cuda}
PY=${PY:-python3}
TEST_S=${TEST_S:-330}
PARTS=${PARTS:-tests serve step graph}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .whl ] && [ "$DEVICE" != cpu ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site || exit 1
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1
  $PY -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
  grep -m1 'model name' /proc/cpuinfo; nproc
} >"$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

$PY -m bench.shape_model fill .gpu/smol || exit 1
[ "$DEVICE" = cpu ] && trap 'rm -f .gpu/smol/model.safetensors' EXIT  # here: no 270 MB left to carry
# kvgate's C++ kernels, built (or found) before any part, so no part's timeout pays for the build; a
# CUDA engine uses them for its host-side draw (kvgate.sampling.host_draw_kernels)
timeout 400 $PY -m kvgate.models.native 2>&1 | tail -1 | tee "$OUT/native.txt"

if [[ " $PARTS " == *" tests "* ]]; then
echo "== tests on $DEVICE"
KVGATE_TEST_DEVICE=$DEVICE KVGATE_CUDA_MODEL=$PWD/.gpu/smol timeout -s INT -k 10 "$TEST_S" $PY -m pytest -q -m "not slow" \
  -p no:cacheprovider --timeout 300 --maxfail=40 -rfE --tb=short \
  tests/test_cuda.py tests/test_memory.py::test_cuda_peak_allocated_within_plan tests/test_decode_graphs.py \
  tests/test_batching.py tests/test_engine_contract.py tests/test_admission.py tests/test_prefix_cache.py \
  tests/test_spec_sample.py tests/test_speculate.py tests/test_structured.py tests/test_logprobs.py \
  tests/test_prompt_logprobs.py tests/test_server.py tests/test_cancel.py >"$OUT/pytest.txt" 2>&1
echo "pytest rc=$?"; tail -40 "$OUT/pytest.txt"
fi

if [[ " $PARTS " == *" serve "* ]]; then
for G in ${SERVE_GRAPHS:-full on off}; do
[ "$DEVICE" = cpu ] && G=off  # a CPU refuses --cuda-graphs on
echo "== served on $DEVICE, --cuda-graphs $G ${SERVE_FLAGS:-}"
PORT=$($PY -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
$PY -m kvgate.cli serve --model .gpu/smol --device "$DEVICE" --port "$PORT" --log-level info --cuda-graphs "$G" \
  --served-model-name smol-shape ${SERVE_FLAGS:-} >"$OUT/serve_$G.log" 2>&1 &
SERVER=$!
UP=0
for _ in $(seq 120); do
  $PY -c "import httpx, sys; sys.exit(httpx.get('http://127.0.0.1:$PORT/health').status_code != 200)" 2>/dev/null && { UP=1; break; }
  kill -0 $SERVER 2>/dev/null || break
  sleep 0.5
done
[ $UP = 1 ] || echo "the server did not come up within 60 s (serve_$G.log says why); the bench below fails at once"
timeout 110 $PY -m kvgate.cli bench --base-url "http://127.0.0.1:$PORT" --input-len 256 --output-len 128 \
  --eos-mode ignore_eos --concurrency ${BENCH_C:-1,16,64} --max-seconds ${BENCH_S:-20} --quiet \
  --json "$OUT/bench_$G.json" >"$OUT/bench_$G.txt" 2>&1
echo "bench rc=$?"; cat "$OUT/bench_$G.txt" | tail -30
kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null
grep -E "decode graphs|WARNING|ERROR|Traceback" "$OUT/serve_$G.log" | head -5
[ "$DEVICE" = cpu ] && break
done
fi

if [[ " $PARTS " == *" step "* ]]; then
echo "== decode step on $DEVICE"
timeout ${STEP_S:-90} $PY -m bench.profile_step --model .gpu/smol --device "$DEVICE" --dtype bfloat16 --rows 1 16 64 \
  --steps 10 >"$OUT/step.txt" 2>&1
cat "$OUT/step.txt" | tail -8
fi

if [[ " $PARTS " == *" graph "* ]]; then
echo "== the engine step with CUDA graphs on and off on $DEVICE"
timeout ${GRAPH_S:-150} $PY -m bench.cuda_graph_probe --model .gpu/smol --device "$DEVICE" --rows ${GRAPH_ROWS:-1 16 64} \
  --profile >"$OUT/graph.txt" 2>&1
grep -v USDT "$OUT/graph.txt" | head -16
fi
