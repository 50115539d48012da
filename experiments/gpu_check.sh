#!/usr/bin/env bash
# The one prepared check for a CUDA machine (one H200, torch 2.11, triton 3.6, no internet, no pip).
# Run from anywhere:  bash experiments/gpu_check.sh
# Time: about 6 minutes (5 min 15 s at ceda1c4, before the two batch-1 runs); every step has a
# timeout (13 minutes together). GPU_CHECK_DEADLINE_S=N
# skips every step that could still be running N seconds after the start (a lease's remaining time),
# so the archive is always written; the steps run most telling first (the numbers below are topics,
# not the order).
#   1. the kernel tests with Triton COMPILED (TRITON_INTERPRET=0; the tests also run torch on CUDA)
#   2. the kernel benchmark at 1M..256M elements against torch's AdamW and the copy bandwidth
#   3. engine smoke runs (world size 1, NCCL), one per stage (zero-ref train --device cuda), and five
#      timed throughput runs under torchrun (experiments/throughput.py), and the largest batch that
#      fits 10 GB, found on meta tensors and then run with the device held to 10 GB
#   4. the performance model's compute and optimizer rates measured on the device, and its
#      prediction of the timed run beside the measurement (experiments/gpu_calibrate.py)
#   5. engine checks (experiments/gpu_engine_check.py, world size 1, NCCL): every stage with the
#      compiled kernels within 1e-4 of torch.optim.AdamW on the same device after 6 steps (CUDA's
#      kernels contract multiply-adds, so not bit for bit as on the CPU), host syncs per step, the CUDA streams a
#      step uses (reductions waited on a side stream), bf16 with reduce_dtype="fp32" beside bf16
#      reductions, device memory added by a pinned save and by full_state_dict(device="cpu"), the
#      CUDA RNG restored by a load, a new engine after close(), activation checkpoints on the
#      device after a forward, plain against Pa+cpu, and the caching-allocator model's peak
#      reserved bytes against CUDA's own on a recorded memory history (with and without MD)
# Everything lands in results/gpu/; when $OUT is set, results/gpu is archived there too, even if a
# step fails (the trap below), so a failed run still brings its logs back. A failing step does
# not stop the later ones; the script exits 1 at the end, listing the failed steps.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p results/gpu

copy_out() {
    # One archive: the device tool brings back at most 8 files, none deeper than $OUT/a/b/.
    if [[ -n "${OUT:-}" ]]; then
        tar -czf "$OUT/gpu_results.tar.gz" -C results gpu
    fi
}
trap copy_out EXIT

export TRITON_INTERPRET=0   # compiled kernels: the tests default to the interpreter otherwise
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
DEADLINE=${GPU_CHECK_DEADLINE_S:-0}

FAILED=()
step() {
    # step NAME LIMIT_S COMMAND...: run one named step whose own timeout is LIMIT_S; record a failure
    # and go on, so one run reports on every step; skip it if it could outlast the deadline.
    local name=$1 limit=$2
    shift 2
    echo "== $name"
    if (( DEADLINE > 0 && SECONDS + limit > DEADLINE )); then
        echo "!! step skipped: $name (at ${SECONDS} s it could run past GPU_CHECK_DEADLINE_S=$DEADLINE)"
        FAILED+=("$name (skipped)")
    elif ! "$@"; then
        echo "!! step failed: $name"
        FAILED+=("$name")
    fi
}

gpu_info() {
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader \
        | tee results/gpu/gpu.txt
    python3 -c "import torch as t, triton as tr; print('torch', t.__version__, 'triton', tr.__version__)" \
        | tee -a results/gpu/gpu.txt
    # the revision checked: a copied tree whose .git is not the code's own is named by
    # ZERO_REF_REVISION, which the CSVs' provenance (cli.py, experiments/provenance.py) reads too
    echo "zero-ref ${ZERO_REF_REVISION:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}" \
        | tee -a results/gpu/gpu.txt
    date -u +%Y-%m-%dT%H:%M:%SZ | tee -a results/gpu/gpu.txt
}

kernel_tests() {
    timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py 2>&1 \
        | tee results/gpu/test_kernels.log
}

engine_checks() {
    timeout 80 python3 experiments/gpu_engine_check.py --out results/gpu 2>&1 | tee results/gpu/engine_check.log
}

# Timed throughput runs (experiments/throughput.py under torchrun, NCCL, world 1): a 24 x 1024 GPT-2
# (about 350M parameters), bf16, plain checkpoints, 1024 tokens a sequence, at stage 2 with 8, 2 and
# 1 sequences and at stage 3 with 8 and 1 (one sequence: little GPU work, so the phases show the
# host's own time: the performance model's host term, gpu_calibrate.host_floors): phases, TFLOPS
# per GPU (recomputation counted), peak memory, elements moved, in
# results/gpu/throughput/throughput.csv, the GPU points the performance model is checked on.
throughput_run() {
    timeout 40 torchrun --standalone --nproc_per_node 1 -m experiments.throughput --layers 24 --hidden 1024 \
        --heads 16 --seq 1024 --vocab 50257 --batch "$2" --stage "$1" --dtype bf16 --steps 10 --warmup 3 \
        --profile-steps 1 --out results/gpu/throughput 2>&1 | tee -a results/gpu/throughput.log
}

# The performance model on this device (experiments/gpu_calibrate.py): bf16 block and head rates
# over a (tokens, hidden) grid, the engine's optimizer step rate, the host's time to issue a block,
# stage 3's own work beside its collectives (stage 3 minus stage 0 on a 4 x 1024 GPT),
# then the model's phases against the timed runs: results/gpu/calibration.json, model_vs_measured.csv.
calibration() {
    timeout 65 torchrun --standalone --nproc_per_node 1 experiments/gpu_calibrate.py measure --out results/gpu \
        2>&1 | tee results/gpu/calibration.log
}
model_check() {
    timeout 20 python3 experiments/gpu_calibrate.py compare --out results/gpu 2>&1 | tee -a results/gpu/calibration.log
}

# The largest batch in a memory budget, held to it (throughput.py --max-batch-budget-gb): the
# search runs the same model and engine on meta tensors (alloc_trace) and replays every step, the
# first included, through the caching-allocator model; the timed run is then capped at the budget
# by set_per_process_memory_fraction, so a search that undercounts what CUDA's caching allocator
# needs fails here with out-of-memory.
budget_run() {
    timeout 90 torchrun --standalone --nproc_per_node 1 -m experiments.throughput --layers 24 --hidden 1024 \
        --heads 16 --seq 1024 --vocab 50257 --stage 2 --dtype bf16 --steps 6 --warmup 2 --profile-steps 1 \
        --max-batch-budget-gb 10 --out results/gpu/budget 2>&1 | tee results/gpu/budget.log
}

kernel_bench() {
    timeout 80 python3 experiments/bench_kernels.py --out results/gpu \
        --sizes 1M,4M,16M,64M,256M --repeats 20 2>&1 | tee results/gpu/bench_kernels.log
}

# Engine smoke runs: one world-size-1 NCCL run per stage, a 4-layer GPT-2 (about 19M parameters) in
# bf16 with the fused Triton kernels ("auto" picks them on CUDA); each appends rows to
# results/gpu/engine_smoke.csv (loss, memory by category, peak device memory, elements moved,
# median step time, GPU name).
engine_smoke() {
    timeout 30 python3 -m zero_ref.cli train --stage "$1" --dtype bf16 --nproc 1 --device cuda \
        --steps 12 --layers 4 --hidden 512 --heads 8 --vocab 8192 --seq 256 --batch 16 \
        --kernels auto --csv results/gpu/engine_smoke.csv 2>&1 | tee -a results/gpu/engine_smoke.log
}

rm -rf results/gpu/budget results/gpu/throughput
rm -f results/gpu/engine_smoke.csv results/gpu/engine_smoke.log results/gpu/throughput.log
step "GPU" 10 gpu_info
step "kernel tests (compiled Triton)" 120 kernel_tests
step "engine checks (exactness, syncs, streams, fp32 reductions, pinned saves, RNG, close)" 80 engine_checks
for run in "2 8" "2 2" "2 1" "3 8" "3 1"; do
    read -r stage batch <<< "$run"
    step "throughput run, stage $stage, batch $batch (torchrun, NCCL, world 1)" 40 throughput_run "$stage" "$batch"
done
step "calibration (compute and optimizer rates, stage 3's own work, bf16)" 65 calibration
step "performance model against the timed runs" 20 model_check
step "largest batch in 10 GB, then held to 10 GB (torchrun, NCCL, world 1)" 90 budget_run
step "kernel benchmark" 80 kernel_bench
for stage in 0 1 2 3; do
    step "engine smoke, stage $stage (NCCL, world 1)" 30 engine_smoke "$stage"
done

if (( ${#FAILED[@]} )); then
    echo "== FAILED steps: ${FAILED[*]}"
    exit 1
fi
echo "== all steps passed"
