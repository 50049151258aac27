#!/usr/bin/env bash
# Every GPU check, over gloo (two ranks sharing GPU 0) and over NCCL (one rank, a world-size-1 NCCL
# group), then a short GPU benchmark (OverlapDDP against stock DDP on resnet18), from the checkout:
# installs nothing, needs torch >= 2.11 with CUDA, under 5 minutes on one GPU (the two timeouts below).
#
#     tests/gpu/run.sh
#
# Checks that need two GPUs skip on one and say so. The last lines list what ran on which backend.
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
export CUBLAS_WORKSPACE_CONFIG=":4096:8"  # deterministic cuBLAS, so bit-equality with DDP means something
python3 - <<'PY' || exit 1
import torch
import torch.distributed as dist
assert torch.cuda.is_available(), "tests/gpu/run.sh needs a CUDA GPU"
count = torch.cuda.device_count()
print(f"torch {torch.__version__}, {count} x {torch.cuda.get_device_name(0)}, NCCL available: {dist.is_nccl_available()}")
if count < 2:
    print("one GPU: the two-GPU NCCL check (device_ids=[rank] without torch.cuda.set_device) is skipped")
PY
status=0
log="$(mktemp)"
timeout 190 python3 -m pytest -q -rA -p no:cacheprovider tests/gpu 2>&1 | tee "$log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
python3 - "$log" <<'PY'
import collections, re, sys

# Tests without a backend in their name: what each runs on.
FIXED = {"test_stream_model.py::test_n": "nccl (the stream model's rules)",
         "test_stream_model.py": "none (the stream model's rules)", "does_not_sync_the_host": "nccl", "device_ids_alone": "nccl", "event_stamps": "none (no collective)",
         "counts_as_done": "none (no collective)", "sparse_gradients_are_bit_equal": "gloo",
         "sparse_gradients_on_nccl": "nccl", "every_wait_has_a_scenario": "none (no collective)"}
ran = collections.defaultdict(collections.Counter)
for line in open(sys.argv[1]):
    found = re.match(r"(PASSED|FAILED|ERROR) (\S+)", line)
    if not found:
        continue
    outcome, node = found.groups()
    params = re.findall(r"\b(gloo|nccl)\b", node)
    backend = params[0] if params else next((b for key, b in FIXED.items() if key in node), "unknown")
    ran[backend][outcome.lower()] += 1
print("what ran on which backend:")
for backend, outcomes in sorted(ran.items()):
    print(f"  {backend}: " + ", ".join(f"{n} {o}" for o, n in sorted(outcomes.items())))
skipped = sum(int(n) for n in re.findall(r"SKIPPED \[(\d+)\]", open(sys.argv[1]).read()))
print(f"  skipped: {skipped} (reasons above)")
PY
rm -f "$log"
# Two ranks share GPU 0 over gloo: the step-time ratio shows the wrapper's overhead on a GPU, not
# NCCL overlap (that needs a GPU per rank). "Exposed communication" is host time on CUDA (NCCL's
# futures complete at enqueue; see docs/cuda.md).
timeout 100 python3 benchmarks/compare.py --model resnet18 --device cuda --world-size 2 \
    --batch-size 32 --steps 10 --warmup 3 --repeats 3 || status=1
exit $status
