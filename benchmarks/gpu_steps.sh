#!/usr/bin/env bash
# One step of an H200 session (docs/gpu.md), run on the GPU machine after staging
# (../shared/gpu/README.md), from a copy of this tree; results go under $OUT (the device tool's
# output folder) or ./gpu-out. Each step fits one call of at most 10 minutes; run them back to
# back (an idle machine is taken back after 30 s).
#
#   bash benchmarks/gpu_steps.sh tests|tests-hidden|tests-rest|bench1b|bench8b|batch16|eager|eager1b|eager8b|hidden1b|hidden8b|
#                                layouts1b|layouts8b|profile|ab|serve|
#                                calibrate1b|calibrate8b|calibrate-start|calibrate-wait|tokenfit
#
# batch16: compiled, the combined kind at batch 16, both shapes, 512 and 2,048 tokens (the cells
# bench1b / bench8b ran for the attention kind only before 2026-12-06's third session).
# hidden1b / hidden8b: compiled, the combined probe (hidden state through the taps) and the
# attention-only probe, 512 and 2,048 tokens x 1 and 64, prefill only and 64 tokens decoded.
# eager: both shapes in eager mode, the attention and the combined (hidden-state) probe kinds,
# 512 tokens x batch 1 and 64; eager1b / eager8b: one shape, 512 and 2,048 tokens x 1, 16, 64.
# ab: the same engine's caller settings side by side: each render group enqueued as it is
# rendered (the default) against everything rendered first (one-chunk).
# calibrate1b / calibrate8b: time to a config, `guardrail calibrate` on the installed pool with a
# dummy-weight model of that shape (its scores mean nothing: the time is what is measured). The
# KV cache is capped (4,096 blocks): calibration's data-mean memos hold the whole stream per KV
# slot, and with vLLM's default memory share they do not fit (refused at install).
# calibrate-start / calibrate-wait: the same for both shapes (CALIBRATE_SHAPES, default "8b 1b")
# end to end in a background process session that outlives each call; calibrate-wait follows it
# (WAIT_S, default 560 s) and brings its logs, times and configs back.
# profile: host ms by phase, 1B compiled, the attention probe (with torch.profiler) and the
# combined one (its read-outs' memo writes and reads, at batch 16 too: where it costs most;
# with torch.profiler, each worker phase's GPU time), about 3 minutes.
# PROBE_LAYOUT (default shipped): the dummy probe of the bench, hidden, eager, profile, ab and
# serve steps: laid out as the shipped config of its kind, or `stress` (128 heads on 16 layers,
# what every table before 2026-12-05's seventh session measured); `layouts1b`: compiled, both
# kinds, both layouts side by side (512 and 2,048 tokens x 64 and 1; about 7 minutes);
# `layouts8b`: the same with the shipped layout only (the stress one was measured at 8B before).
# tokenfit: the time of one token model of calibrate's token read-out on the GPU: one 1B layer
# (2,048) and three layers of the 1B and 8B shapes (6,144, 12,288; benchmarks/token_fit_speed.py);
# then the 84 models of a calibration fitted together on labels at random, 3 one at a time beside.
# GUARDRAIL_COMMIT: the commit the bundle was built from, recorded in every result file (the
# bundle carries the tracked files, no git and no COMMIT file: pass it in each call's command,
# e.g. `GUARDRAIL_COMMIT=$(git rev-parse --short HEAD)` written out here; else "unknown").
set -uo pipefail
step=${1:?usage: gpu_steps.sh tests|tests-hidden|tests-rest|bench1b|bench8b|batch16|eager|eager1b|eager8b|hidden1b|hidden8b|layouts1b|layouts8b|profile|ab|serve|calibrate1b|calibrate8b|calibrate-start|calibrate-wait|tokenfit}
out=${OUT:-$PWD/gpu-out}
mkdir -p "$out"
. /tmp/gpu-env.sh
unset TOKENIZERS_PARALLELISM  # a user's default (the staging script sets it false)
cd "$(dirname "$0")/.."
# guardrail-serve imports guardrail.integrations: in a copied tree that is the top-level folder
[ -e guardrail/integrations ] || ln -s ../integrations guardrail/integrations
[ -e guardrail/policies ] || ln -s ../policies guardrail/policies
[ -e guardrail/model_configs ] || ln -s ../model_configs guardrail/model_configs
export PYTHONPATH=$PWD:$PYTHONPATH
export GUARDRAIL_COMMIT=${GUARDRAIL_COMMIT:-$(cat COMMIT 2>/dev/null || echo unknown)}
quiet() { grep --line-buffered -v " INFO \| WARNING \|DEBUG\|it/s\]"; }
# the GPU tests (pytest's further arguments: "$@" after the log's name), their log written to
# $out as they run (-v names each test as it starts) and cut at TESTS_LIMIT: a call cut short
# still brings back which test it was in
gpu_tests() {
  local log="$out/$1"; shift
  PYTHONUNBUFFERED=1 timeout "${TESTS_LIMIT:-500}" python3 -m pytest -v -s -p no:cacheprovider \
    tests/gpu "$@" 2>&1 | quiet > "$log"
  tail -40 "$log"
}
layout=${PROBE_LAYOUT:-shipped}
case $step in
  tests) gpu_tests gpu_tests.txt ;;
  tests-hidden|tests-rest)  # the suite in two calls: the hidden-state tests, then the others
    select="hidden or memo"; [ "$step" = tests-rest ] && select="not ($select)"
    gpu_tests "gpu_$step.txt" -k "$select" ;;
  bench1b) python3 benchmarks/bench_gpu.py --shapes 1b --plain-text --probe-layouts "$layout" --lengths 512 2048 \
    --kinds attention combined \
    --batches 64 1 16 --max-tokens 1 --out "$out/gpu_1b.json" 2>&1 | grep "^{" ;;
  bench8b) python3 benchmarks/bench_gpu.py --shapes 8b --plain-text --probe-layouts "$layout" --lengths 512 2048 \
    --kinds attention combined \
    --batches 64 16 1 --max-tokens 1 --out "$out/gpu_8b.json" 2>&1 | grep "^{" ;;
  batch16) python3 benchmarks/bench_gpu.py --shapes 1b 8b --modes compiled --kinds combined --plain-text \
    --probe-layouts "$layout" --lengths 512 2048 --batches 16 --max-tokens 1 \
    --out "$out/gpu_batch16.json" 2>&1 | grep "^{" ;;
  eager) python3 benchmarks/bench_gpu.py --shapes 1b 8b --modes eager --kinds attention combined --probe-layouts "$layout" \
    --plain-text --lengths 512 --batches 64 1 --max-tokens 1 --repeats 5 \
    --out "$out/gpu_eager.json" 2>&1 | grep "^{" ;;
  eager1b|eager8b) shape=${step#eager}  # the whole matrix of one shape: 512 and 2,048 x 1, 16, 64
    python3 benchmarks/bench_gpu.py --shapes "$shape" --modes eager --kinds attention combined \
    --probe-layouts "$layout" \
    --plain-text --lengths 512 2048 --batches 64 16 1 --max-tokens 1 --repeats 5 \
    --out "$out/gpu_eager_$shape.json" 2>&1 | grep "^{" ;;
  hidden1b|hidden8b) shape=${step#hidden}  # compiled, the combined probe (taps, worker memos)
    python3 benchmarks/bench_gpu.py --shapes "$shape" --modes compiled --kinds combined attention \
    --probe-layouts "$layout" \
    --lengths 512 2048 --batches 64 1 --max-tokens 1 64 --repeats 5 \
    --out "$out/gpu_hidden_$shape.json" 2>&1 | grep "^{" ;;
  layouts1b|layouts8b) shape=${step#layouts}  # compiled, both kinds, shipped (and stress at 1B)
    both="shipped stress"; [ "$shape" = 8b ] && both=shipped
    # shellcheck disable=SC2086
    python3 benchmarks/bench_gpu.py --shapes "$shape" --modes compiled --kinds attention combined \
    --probe-layouts $both --plain-text --lengths 512 2048 --batches 64 1 --max-tokens 1 \
    --repeats 5 --out "$out/gpu_layouts_$shape.json" 2>&1 | grep "^{" ;;
  profile) python3 benchmarks/profile_phases.py --probe-layout "$layout" --shape 1b --cases 1x512 64x512 --rounds 5 \
    --torch-profile --out "$out/phases.json" 2>&1 | quiet | tail -80
    # the combined kind's phases too: its read-outs' memo writes and reads, the end of step's parts
    python3 benchmarks/profile_phases.py --probe-layout "$layout" --kind combined --shape 1b \
      --cases 1x512 16x512 64x512 --rounds 5 --torch-profile \
      --out "$out/phases_combined.json" 2>&1 | quiet | tail -120 ;;
  ab) python3 benchmarks/profile_phases.py --probe-layout "$layout" --shape 1b --cases 1x512 16x512 64x512 --rounds 5 \
    --variants default one-chunk --out "$out/phases_ab.json" 2>&1 | quiet | tail -30 ;;
  serve) python3 benchmarks/load_serving.py --model dummy-1b --device gpu --rounds 1 \
    --probe-layout "$layout" \
    --clients 32 64 --requests 128 --no-doc --start-timeout 200 2>&1 | quiet | tail -40
    cp benchmarks/results/load_serving_dummy-1b_gpu*.json "$out/" ;;
  calibrate1b|calibrate8b) shape=${step#calibrate}
    model=$(python3 -c "from pathlib import Path; from guardrail.testing.dummy_models import \
build_dummy_model; print(build_dummy_model('$shape', Path('/tmp/guardrail-bench')))")
    start=$(date +%s.%N)
    # the score cache on the machine's disk (and the token models beside it): a rerun of the
    # step in the same lease resumes after scoring, or after the token models, where the
    # first ran out of time
    # written straight to $out (unbuffered): a call cut short still brings back what it printed;
    # 540 s, so that a call which staged first (about 30 s) ends inside its 600 s
    PYTHONUNBUFFERED=1 timeout "${CALIBRATE_LIMIT:-540}" python3 -m guardrail.cli calibrate \
      --model "$model" --out "$out/calibrate_$shape" --scores-cache "/tmp/calibrate_$shape.npz" \
      --engine-arg load_format=dummy --engine-arg num_gpu_blocks_override=4096 \
      --batch-size 64 > "$out/calibrate_$shape.log" 2>&1
    tr '\r' '\n' < "$out/calibrate_$shape.log" | quiet | grep -v "^$" | tail -40
    echo "calibrate $shape: $(python3 -c "import time; print(round(time.time() - $start, 1))") s \
wall, engine start included" | tee "$out/calibrate_$shape.time" ;;
  calibrate-start)  # both shapes end to end, one after the other, past the 10-minute calls: a
    # new process session outlives the call (the device tool keeps it until the machine goes
    # back); `calibrate-wait` calls, back to back, follow it and bring its files back
    rm -rf /tmp/calibrate-bg && mkdir -p /tmp/calibrate-bg
    setsid nohup env OUT=/tmp/calibrate-bg CALIBRATE_LIMIT=3000 bash -c \
      'for shape in ${CALIBRATE_SHAPES:-8b 1b}; do bash benchmarks/gpu_steps.sh calibrate$shape; done;
       touch /tmp/calibrate-bg/done' > /tmp/calibrate-bg/chain.log 2>&1 < /dev/null &
    echo "calibrate started in the background (shapes ${CALIBRATE_SHAPES:-8b 1b})" ;;
  calibrate-wait)  # until the background chain is done, or ${WAIT_S:-560} s; its files to $OUT
    waited=0
    while [ ! -e /tmp/calibrate-bg/done ] && [ "$waited" -lt "${WAIT_S:-560}" ]; do
      sleep 10; waited=$((waited + 10))
    done
    [ -e /tmp/calibrate-bg/done ] && echo "done" || echo "still running after ${waited} s"
    cp -r /tmp/calibrate-bg/. "$out/"
    for f in /tmp/calibrate-bg/calibrate_*.log; do
      [ -e "$f" ] && { echo "== $f"; tr '\r' '\n' < "$f" | quiet | grep -v "^$" | tail -6; }
    done
    cat /tmp/calibrate-bg/*.time 2>/dev/null ;;
  tokenfit) python3 benchmarks/token_fit_speed.py --widths 2048 6144 12288 \
    --out "$out/token_fit_speed.json" 2>&1 | grep "^{"
    # the 84 models of a calibration together, on labels at random (as dummy weights give)
    python3 benchmarks/token_fit_speed.py --widths 6144 12288 --labels noise --together \
      --compare 3 --out "$out/token_fit_together.json" 2>&1 | grep "^{" ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
esac
