#!/usr/bin/env bash
# The full `mirrorgrad bench` suite on one GPU, in four parts that each fit one
# 10-minute device command (each part stops itself by ~9 minutes; what did not fit is
# recorded as skipped, never silently dropped):
#
#   bash benchmarks/gpu_suite.sh 1   # planner suite: transformer
#   bash benchmarks/gpu_suite.sh 2   # planner suite: mlp, resnet50, nmt-attention
#   bash benchmarks/gpu_suite.sh 3   # recurrent workloads (lstm-lm-medium, deepspeech2,
#                                    # nmt-attention, lstm-lm-large) with torch.nn vs
#                                    # mirrorgrad.nn RNNs
#   bash benchmarks/gpu_suite.sh 4   # largest batch under 4 GB (benchmarks/max_batch.py)
#   bash benchmarks/gpu_suite.sh 5   # rnn-modules suite (the module table), fp32
#   bash benchmarks/gpu_suite.sh 6   # rnn-modules suite (the module table), bf16
#   bash benchmarks/gpu_suite.sh 7   # zoo sweep of public models (benchmarks/zoo_sweep.py)
#   bash benchmarks/gpu_suite.sh 8   # word-lm: PyTorch's example vs train lm
#   bash benchmarks/gpu_suite.sh 9   # the op's kernels without the module, fp32 and bf16
#
# Results go to $OUT/partN (results.json, results.md, the plots, logs.tar.gz); the
# markdown tables are printed last. Redraw a report elsewhere with
# `mirrorgrad bench --from-json results.json --out DIR`.
#
# Time budget per part: every compiling method is first compiled 8 processes at a
# time (cold Inductor compiles take 10-90 s each on big graphs; in parallel they cost
# ~1/6 of the wall time), then the timed runs go one workload at a time, one process
# per workload, with the caches warm. Each workload gets a fair share of the time left.
set -euo pipefail
part=${1:?usage: gpu_suite.sh 1|2|3|4|5|6|7|8|9}
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
out=${OUT:-bench-results}/part$part
work=$(mktemp -d)
mkdir -p "$out"

# 40 timed steps: step-to-step spread on a 5 ms step was ~10% with 20.
common=(--no-progress --precompile-jobs 8 --method-timeout 300 --steps 40 --warmup 3)
zoo_methods=(eager compile mirror-balance compile-budget-0.5 mirror-budget-0.5
    compile-budget-0.1 mirror-budget-0.3 checkpoint)
bench() { "$py" -m mirrorgrad bench "${common[@]}" "$@"; }
# kernels DTYPE OUT: the op's kernels without the module, one process per shape.
kernels() {
    "$py" benchmarks/rnn_kernels.py --dtype "$1" --no-progress --steps 20 --warmup 3 \
        --time-limit 260 --workload-time 20 --method-timeout 60 --out "$2"
}

case "$part" in
1)
    # Every torch.compile budget and every mirror mode. The Transformer alone: its cold compiles (the budgets' knapsack) take minutes.
    bench --time-limit 530 --out "$work/zoo-transformer" --workloads transformer \
        --methods "${zoo_methods[@]}"
    runs=(zoo-transformer)
    ;;
2)
    # nmt-attention keeps torch.nn's biLSTM encoder here: Dynamo cannot trace it and
    # falls back to eager for the model's forward, compiling each decoder step alone
    # (part 3 runs it with mirrorgrad.nn).
    bench --time-limit 530 --out "$work/zoo" --workloads mlp resnet50 nmt-attention \
        --methods "${zoo_methods[@]}"
    runs=(zoo)
    ;;
3)
    # Recurrent workloads, torch.nn RNNs against mirrorgrad.nn ones (+mgnn): with
    # torch.nn RNNs torch.compile sees little (an LSTM breaks the graph), with
    # mirrorgrad.nn the whole step is one graph for the planner. A cold compile with
    # mirrorgrad.nn RNNs took ~50-60 s on an H100: few methods, one long phase.
    bench --time-limit 540 --out "$work/rnn" \
        --workloads lstm-lm-medium deepspeech2 nmt-attention lstm-lm-large \
        --methods eager compile eager+mgnn compile+mgnn mirror-balance+mgnn \
        mirror-budget-0.5+mgnn checkpoint
    runs=(rnn)
    ;;
4)
    # The largest batch under 4 GB for methods without an Inductor compile (each probe
    # is a fresh process; a compiling probe would be a cold compile at a new shape).
    # max_batch.json is rewritten after each search: what finished stands at a timeout.
    timeout 540 "$py" benchmarks/max_batch.py --cap-gb 4 --max-probes 3 \
        --workloads lstm-lm-large deepspeech2 --methods eager eager+mgnn checkpoint \
        --probe-timeout 120 --out "$work/batch" || true
    runs=(batch)
    ;;
5 | 6)
    # torch.nn (cuDNN) and mirrorgrad.nn, plain and in one CUDA Graph, LSTM, GRU and
    # RNN-tanh at seven shapes; Triton kernels compiled first, 8 processes at a time.
    dtype=$([ "$part" = 5 ] && echo fp32 || echo bf16)
    "$py" -m mirrorgrad bench --suite rnn-modules --dtype "$dtype" --no-progress --steps 20 \
        --warmup 3 --precompile-jobs 8 --time-limit 540 --method-timeout 90 \
        --out "$work/rnn-modules-$dtype"
    runs=("rnn-modules-$dtype")
    ;;
9)
    # fp32 then bf16 (half the time each).
    kernels fp32 "$work/rnn-kernels-fp32"
    kernels bf16 "$work/rnn-kernels-bf16"
    runs=(rnn-kernels-fp32 rnn-kernels-bf16)
    ;;
7)
    # Every installed model family through eager, torch.compile and the planner's modes,
    # 12 models at a time (peaks and gradients exact; times share the GPU: indicative).
    "$py" benchmarks/zoo_sweep.py --no-progress --jobs 12 --steps 3 \
        --warmup 1 --time-limit 500 --workload-time 150 --method-timeout 120 \
        --out "$work/zoo-sweep"
    runs=(zoo-sweep)
    ;;
8)
    # The LM step of PyTorch's word_language_model against `mirrorgrad train lm`'s,
    # medium and large at batch 20, medium at 128; compiles first, 6 at a time.
    bench --suite word-lm --time-limit 540 --precompile-jobs 6 --out "$work/word-lm"
    runs=(word-lm)
    ;;
*)
    echo "usage: gpu_suite.sh 1|2|3|4|5|6|7|8|9" >&2
    exit 2
    ;;
esac

# Results, the figures and the logs come back from a device command.
for run in "${runs[@]}"; do
    for f in results.json results.md peak_vs_time.png ratios.png module_table.csv \
        module_speedups.png max_batch.json; do
        if [ -f "$work/$run/$f" ]; then cp "$work/$run/$f" "$out/$run.$f"; fi
    done
done
tar -czf "$out/logs.tar.gz" -C "$work" .
for run in "${runs[@]}"; do
    echo
    if [ -f "$work/$run/results.md" ]; then cat "$work/$run/results.md"; fi
done
