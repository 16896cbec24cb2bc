#!/usr/bin/env bash
# GPU host check (run from the repository root on a CUDA machine that has torch but not our deps):
# the CUDA paths of staging (CudaCopier, pinned pool), NIXL VRAM registration, and staged vs direct
# throughput on device KV memory. Wheels for the missing packages may be put in .whl/ (nixl,
# nixl-cu13, msgspec, pyzmq); results go to $OUT (default ./gpu_out).
set -u
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc
python3 -c "import torch, nixl, msgspec; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())" || exit 1
step() { echo "=== $1"; shift; local t0=$SECONDS; "$@"; echo "=== rc=$? in $((SECONDS - t0)) s"; }
step "pytest: CUDA copier and the NIXL staging suite on device KV" timeout 200 python3 -m pytest -q -x \
  -p no:cacheprovider tests/transports/test_staging.py -k "cuda_copier or nixl" -o log_level=WARNING 2>&1 | tail -25
B="timeout 100 python3 -m benchmarks.bench_staging --transport nixl --layers 8 --block-kib 16 --repeat 5 --json"
bench() { local name=$1; shift; step "bench $name: $*" $B "$@" 2>&1 | grep -v "NIXL INFO" | tee "$OUT/$name.txt"; }
# Direct READ of same-node VRAM with UCX's own cuda_ipc GET setting (auto: off without NVLink), then ours.
UCX_CUDA_IPC_ENABLE_GET_ZCOPY=auto bench cuda_pull_get_auto --device cuda --size-mib 1024 --chunk-kib ""
bench cuda_pull_seq --device cuda --mode pull --size-mib 1024 --chunk-kib 4096,16384
bench cuda_pull_seq_t4 --device cuda --mode pull --size-mib 1024 --chunk-kib 4096,16384 --num-threads 4
bench cuda_push_seq_t4 --device cuda --mode push --size-mib 1024 --chunk-kib 16384 --num-threads 4
bench cuda_pull_shuf --device cuda --mode pull --order shuffled --size-mib 256 --chunk-kib 4096 --num-threads 4
