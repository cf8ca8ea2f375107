#!/usr/bin/env bash
# The GPU checks of sharded optimizer state (issue 25), on one NVIDIA GPU, in < 3 minutes:
#
#   bash benchmarks/gpu_sharded_check.sh            # from the repository root
#
# 1. the `cuda`-marked tests: tests/test_cuda_sharded_state.py (one NCCL rank; two ranks
#    sharing the GPU over gloo, which runs the parameter exchange on the side stream; a
#    checkpoint round trip), and the older CUDA tests of tests/test_optimizer_in_backward.py;
# 2. whether NCCL takes two ranks on one GPU (it is expected to refuse: "Duplicate GPU");
# 3. a short timing: overlapkit bench --device cuda --only sharded_state --world-size 1
#    (plain DDP + Adam, overlap_ddp, sharded, ZeroRedundancyOptimizer with and without
#    overlap_with_ddp; one rank, so "sharded" shows the engine's and the exchange's cost,
#    not a saving).
#
# It runs overlapkit from this checkout (PYTHONPATH), with the machine's own torch: the
# project pins torch==2.13.0, which such a machine may not have; the script prints the
# version it used. Results also go to $OUT (when set) or ./gpu-sharded-check/.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUTDIR=${OUT:-gpu-sharded-check}
mkdir -p "$OUTDIR"
# _vendor/: pure-Python dependencies the machine may lack (importlib_metadata), copied in
export PYTHONPATH="$PWD:$PWD/_vendor${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 \
    OMP_NUM_THREADS=4
"$PY" -c "import importlib_metadata, attrs, pluggy" || echo "missing a dependency of overlapkit (above): pip install importlib-metadata attrs pluggy, or copy them into _vendor/"
status=0

echo "== machine"
nvidia-smi -L || true
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'devices', torch.cuda.device_count())"

echo "== 1. cuda tests"
timeout 150 "$PY" -m pytest -q -ra -m cuda -p no:cacheprovider \
    tests/test_cuda_sharded_state.py tests/test_optimizer_in_backward.py \
    --junitxml="$OUTDIR/cuda-tests.xml" 2>&1 | tee "$OUTDIR/cuda-tests.log" || status=1

echo "== 2. NCCL, two ranks on one GPU"
NCCL_CHECK=$(mktemp -d)/nccl_two_ranks_one_gpu.py  # a file: spawned ranks re-import it
cat > "$NCCL_CHECK" <<'PYEOF'
import multiprocessing as mp
import os
import socket


def worker(rank, port, results):
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        torch.cuda.set_device(0)  # both ranks on the one GPU
        dist.init_process_group("nccl", rank=rank, world_size=2)
        tensor = torch.ones(4, device="cuda:0") * (rank + 1)
        dist.all_reduce(tensor)
        torch.cuda.synchronize()
        results.put((rank, f"ran: all_reduce gave {float(tensor[0])}"))
    except Exception as exc:
        results.put((rank, f"{type(exc).__name__}: {exc}".splitlines()[0][:300]))


if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    results = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, port, results)) for r in range(2)]
    for proc in procs:
        proc.start()
    seen = {}
    import queue
    try:
        while len(seen) < 2:
            rank, text = results.get(timeout=45)
            seen[rank] = text
    except queue.Empty:
        pass
    for proc in procs:
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
    for rank in range(2):
        print(f"NCCL, two ranks on cuda:0, rank {rank}:", seen.get(rank, "no answer in 45 s (hung)"))
PYEOF
timeout 60 "$PY" "$NCCL_CHECK" 2>&1 | tee "$OUTDIR/nccl-two-ranks.log"

echo "== 3. timing (one NCCL rank)"
timeout 120 "$PY" -m overlapkit bench --device cuda --only sharded_state --world-size 1 \
    --rounds 3 --json > "$OUTDIR/bench.json" 2> "$OUTDIR/bench.err" || status=1
tail -3 "$OUTDIR/bench.err"
"$PY" - "$OUTDIR/bench.json" <<'PYEOF' || status=1
import json, sys
from overlapkit.cli.bench.runner import format_result
for result in json.load(open(sys.argv[1])):
    print(format_result(result))
PYEOF
exit $status
