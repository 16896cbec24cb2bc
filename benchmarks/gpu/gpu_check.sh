#!/usr/bin/env bash
# The GPU end-to-end check (benchmarks/gpu/gpu_check.py, `make gpu-check`) from anywhere on a CUDA host
# whose python3 has torch; wheels for what cannot be downloaded there may be put in .whl/.
#   benchmarks/gpu/gpu_check.sh [--out DIR] [--wheels DIR] [--steps a,b] [--dry-run]
cd "$(dirname "$0")/../.." && exec python3 -m benchmarks.gpu.gpu_check "$@"
