#!/usr/bin/env bash
# IsoQuant kernels on an NVIDIA GPU in one command (MLX's CUDA backend installed:
# `pip install -e '.[cuda]'`): attention benchmark, GPU tests, end-to-end decode.
# Each stage has its own time limit and writes into $OUT, so a stage that fails or runs out
# still leaves the others' results.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
OUT=${OUT:-/tmp/iq_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv | tee "$OUT/gpu.txt"
timeout ${BENCH_S:-230} python3 benchmarks/attention_decode.py --out "$OUT/attention_decode.json" 2>&1 | tee "$OUT/attention.txt"
MLX_ENABLE_TF32=0 timeout ${TESTS_S:-170} python3 -m pytest tests/gpu/test_isoquant_gpu.py -q -n 8 -p no:cacheprovider -p no:benchmark \
  -o addopts="" 2>&1 | tail -60 | tee "$OUT/gpu_tests.txt"
timeout ${E2E_S:-140} python3 benchmarks/e2e_decode_isoquant.py --reference --compare-encoder --compare-fold --steps 32 \
  --out "$OUT/e2e_decode_isoquant.json" 2>&1 | tee "$OUT/e2e.txt"
# GPU-only kernel durations (warm caches, boost clocks), when Nsight Compute is there
if command -v ncu >/dev/null; then
  timeout ${NCU_S:-90} ncu --cache-control none --clock-control none --target-processes all -k regex:iq_ \
    --section SpeedOfLight --csv --page details python3 benchmarks/isoquant_ncu.py 1x2048 1x2048e 8x2048 \
    1x32768 8x32768 > "$OUT/ncu.csv" 2> "$OUT/ncu.err"
fi
timeout ${HOST_S:-60} python3 benchmarks/isoquant_host.py --out "$OUT/isoquant_host.json" 2>&1 | tail -8
echo done
