#!/usr/bin/env bash
# The one prepared check for a CUDA machine (one H200, torch 2.11, triton 3.6, no internet, no pip).
# Run from anywhere:  bash experiments/gpu_check.sh
# Time: typically 4 minutes; every step has a timeout and the timeouts add up to 9.5 minutes.
#   1. the kernel tests with Triton COMPILED (TRITON_INTERPRET=0; the tests also run torch on CUDA)
#   2. the kernel benchmark at 1M..256M elements against torch's AdamW and the copy bandwidth
#   3. engine smoke runs (world size 1, NCCL), one per stage (zero-ref train --device cuda), and three
#      timed throughput runs under torchrun (experiments/throughput.py)
#   4. the performance model's compute and optimizer rates measured on the device, and its
#      prediction of the timed run beside the measurement (experiments/gpu_calibrate.py)
#   5. engine checks (experiments/gpu_engine_check.py, world size 1, NCCL): every stage exact
#      against torch.optim.AdamW with the compiled kernels, host syncs per step, the CUDA streams a
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

FAILED=()
step() {
    # Run one named step; record a failure and go on, so one run reports on every step.
    local name=$1
    shift
    echo "== $name"
    if ! "$@"; then
        echo "!! step failed: $name"
        FAILED+=("$name")
    fi
}

gpu_info() {
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader \
        | tee results/gpu/gpu.txt
    python3 -c "import torch as t, triton as tr; print('torch', t.__version__, 'triton', tr.__version__)" \
        | tee -a results/gpu/gpu.txt
    # the revision checked; a copied tree without .git is named by ZERO_REF_REVISION
    echo "zero-ref ${ZERO_REF_REVISION:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}" \
        | tee -a results/gpu/gpu.txt
    date -u +%Y-%m-%dT%H:%M:%SZ | tee -a results/gpu/gpu.txt
}

kernel_tests() {
    timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py 2>&1 \
        | tee results/gpu/test_kernels.log
}

kernel_bench() {
    timeout 80 python3 experiments/bench_kernels.py --out results/gpu \
        --sizes 1M,4M,16M,64M,256M --repeats 20 2>&1 | tee results/gpu/bench_kernels.log
}

step "GPU" gpu_info
step "kernel tests (compiled Triton)" kernel_tests
step "kernel benchmark" kernel_bench

# --- engine smoke runs ---
# One world-size-1 NCCL run per stage: a 4-layer GPT-2 (about 19M parameters) in bf16 with the
# fused Triton kernels ("auto" picks them on CUDA); each appends rows to results/gpu/engine_smoke.csv
# (loss, memory by category, peak device memory, elements moved, median step time, GPU name).
engine_smoke() {
    timeout 30 python3 -m zero_ref.cli train --stage "$1" --dtype bf16 --nproc 1 --device cuda \
        --steps 12 --layers 4 --hidden 512 --heads 8 --vocab 8192 --seq 256 --batch 16 \
        --kernels auto --csv results/gpu/engine_smoke.csv 2>&1 | tee -a results/gpu/engine_smoke.log
}
rm -f results/gpu/engine_smoke.csv results/gpu/engine_smoke.log
for stage in 0 1 2 3; do
    step "engine smoke, stage $stage (NCCL, world 1)" engine_smoke "$stage"
done

# --- timed throughput runs (experiments/throughput.py under torchrun, NCCL, world 1) ---
# A 24 x 1024 GPT-2 (about 350M parameters), bf16, plain checkpoints, 1024 tokens a sequence, at
# stage 2 with 8 and 2 sequences and at stage 3 with 8: phases, TFLOPS per GPU (recomputation
# counted), peak memory, elements moved, in results/gpu/throughput/throughput.csv, the GPU points
# the performance model is checked on (below).
throughput_run() {
    timeout 40 torchrun --standalone --nproc_per_node 1 -m experiments.throughput --layers 24 --hidden 1024 \
        --heads 16 --seq 1024 --vocab 50257 --batch "$2" --stage "$1" --dtype bf16 --steps 10 --warmup 3 \
        --profile-steps 1 --out results/gpu/throughput 2>&1 | tee -a results/gpu/throughput.log
}
rm -f results/gpu/throughput.log results/gpu/throughput/throughput.csv
for run in "2 8" "2 2" "3 8"; do
    read -r stage batch <<< "$run"
    step "throughput run, stage $stage, batch $batch (torchrun, NCCL, world 1)" throughput_run "$stage" "$batch"
done

# --- the performance model on this device (experiments/gpu_calibrate.py) ---
# bf16 block and head rates over a (tokens, hidden) grid and the engine's optimizer step rate, then
# the model's phases against the timed runs above: results/gpu/calibration.json, model_vs_measured.csv.
calibration() {
    timeout 50 torchrun --standalone --nproc_per_node 1 experiments/gpu_calibrate.py measure --out results/gpu \
        2>&1 | tee results/gpu/calibration.log
}
model_check() {
    timeout 20 python3 experiments/gpu_calibrate.py compare --out results/gpu 2>&1 | tee -a results/gpu/calibration.log
}
step "calibration (compute and optimizer rates, bf16)" calibration
step "performance model against the timed run" model_check

engine_checks() {
    timeout 80 python3 experiments/gpu_engine_check.py --out results/gpu 2>&1 | tee results/gpu/engine_check.log
}
step "engine checks (exactness, syncs, streams, fp32 reductions, pinned saves, RNG, close)" engine_checks

if (( ${#FAILED[@]} )); then
    echo "== FAILED steps: ${FAILED[*]}"
    exit 1
fi
echo "== all steps passed"
