#!/usr/bin/env bash
# The GPU checks (docs/gpu.rst): every test marked `cuda`, then the overlap_ddp benchmark
# on one GPU over NCCL with its compute-only limit. Run from the repository root on a
# machine with an NVIDIA GPU and a CUDA build of torch; overlapkit is used from the
# source tree (PYTHONPATH), so the machine's own torch is what runs, whatever version.
# Each stage has a time limit, so a hang fails the check instead of eating the machine.
#   usage: benchmarks/gpu_check.sh [OUTDIR]     (results: OUTDIR/gpu-*.txt, -json)
set -u
out=${1:-gpu-results}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# A GPU host may be offline and lack overlapkit's pure-Python dependencies: install the
# missing ones from a wheel folder carried along (pip download -d gpu-wheels ...).
if [ -d "${GPU_WHEELS:-gpu-wheels}" ]; then
  for pair in pluggy:pluggy attrs:attrs importlib_metadata:importlib-metadata zipp:zipp \
              pytest:pytest pytest_timeout:pytest-timeout iniconfig:iniconfig; do
    python3 -c "import ${pair%%:*}" 2>/dev/null || python3 -m pip install -q --no-index \
        --find-links "${GPU_WHEELS:-gpu-wheels}" "${pair##*:}" 2>&1 | tail -2
  done
fi
python3 - <<'PY' 2>&1 | tee "$out/gpu-env.txt"
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda,
      torch.cuda.get_device_name() if torch.cuda.is_available() else "NO GPU")
PY
status=0
timeout 300 python3 -m pytest -q -p no:cacheprovider -m cuda -rA --timeout 240 \
    ${GPU_TESTS:-tests/test_optimizer_in_backward.py tests/test_cuda_*.py tests/trainers/test_lightning_gpu.py} 2>&1 | tee "$out/gpu-tests.txt" | tail -40
[ "${PIPESTATUS[0]}" = 0 ] || status=1
if [ -z "${SKIP_BENCH:-}" ]; then
  timeout 240 python3 -m overlapkit bench --device cuda --only overlap_ddp --world-size 1 \
      --quick --json > "$out/gpu-bench.json" 2> "$out/gpu-bench.err" || status=1
  tail -c 3000 "$out/gpu-bench.json"; tail -20 "$out/gpu-bench.err"
fi
exit $status
