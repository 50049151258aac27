#!/usr/bin/env bash
# Every GPU check, then a short GPU benchmark (OverlapDDP against stock DDP on resnet18), from the
# checkout: installs nothing, needs torch >= 2.11 with CUDA, about 3 minutes on one GPU.
#
#     tests/gpu/run.sh
#
# Checks that need two GPUs skip on one and say so (pytest -rs lists every skip with its reason).
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
export CUBLAS_WORKSPACE_CONFIG=":4096:8"  # deterministic cuBLAS, so bit-equality with DDP means something
python3 - <<'PY' || exit 1
import torch
assert torch.cuda.is_available(), "tests/gpu/run.sh needs a CUDA GPU"
count = torch.cuda.device_count()
print(f"torch {torch.__version__}, {count} x {torch.cuda.get_device_name(0)}")
if count < 2:
    print("one GPU: the two-GPU NCCL check (device_ids=[rank] without torch.cuda.set_device) is skipped")
PY
status=0
timeout 200 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu || status=1
# Two ranks share GPU 0 over gloo: the step-time ratio shows the wrapper's overhead on a GPU, not
# NCCL overlap (that needs a GPU per rank). "Exposed communication" is host time on CUDA (NCCL's
# futures complete at enqueue; see docs/cuda.md).
timeout 100 python3 benchmarks/compare.py --model resnet18 --device cuda --world-size 2 \
    --batch-size 32 --steps 10 --warmup 3 --repeats 3 || status=1
exit $status
