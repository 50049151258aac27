"""overlapddp.integrations.ray: Ray Train's prepare_model with OverlapDDP, bit-equal to Ray's own DDP.

One Ray cluster for the module, two nodes on this machine (``tests/support/ray_cluster.py``), one CPU each,
and one ``TorchTrainer`` run of two gloo workers, one per node. The training function builds the
same network twice, once with Ray's ``prepare_model`` (DDP) and once with ours, trains both on the
same rank-dependent batches with gradient accumulation through ``no_sync``, and writes both models'
parameters and gradients after every step to a folder the tests read. It reports a checkpoint with
``ray.train.report`` after each of the first steps; then one worker dies, Ray's failure handling
restarts both from that checkpoint, and the steps trained again must equal the first attempt's.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from tests.support.ray_cluster import HEAD_IP, SECOND_IP, RayCluster

REPO = Path(__file__).resolve().parents[2]
STEPS, ACCUMULATE, FAIL_AT = 4, 2, 2  # optimizer steps, micro-batches per step, the checkpoint resumed from
KWARGS = {"bucket_cap_mb": 0.001}  # several buckets
# Ray Train's controller polls the workers every 2 s and gives a worker group 60 s to start; polled
# more often the runs take half the time, and a loaded CI machine may need longer to start workers.
RAY_TRAIN_ENV = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5", "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "300",
                 "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("ray") is None, reason="ray is not installed (python3 -m pip install -e '.[ray]')"
)


def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))


def _batch(rank: int, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same batch for a rank, step and micro-batch in every attempt, different across ranks."""
    generator = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
    inputs = torch.randn(4, 16, generator=generator)
    return inputs, inputs.sum(dim=1, keepdim=True).sin()


def _flat(tensors: Any) -> np.ndarray:
    return torch.cat([t.detach().reshape(-1) for t in tensors]).numpy().copy()


def _train(config: dict[str, Any]) -> None:
    """Ray's DDP and OverlapDDP side by side; the first attempt trains every step, the second resumes.

    The first attempt reports a checkpoint after each of the first ``FAIL_AT`` steps, trains the rest
    without one (its parameters are what an uninterrupted run gives), and then worker 1 dies. Ray
    restarts both workers; the second attempt starts from the checkpoint of step ``FAIL_AT``.
    """
    import ray.train
    import ray.train.torch

    from overlapddp.integrations.ray import prepare_model

    context = ray.train.get_context()
    rank = context.get_world_rank()
    out = Path(config["out"])
    attempt = len(list(out.glob(f"start_r{rank}_*"))) + 1
    torch.manual_seed(0)
    net = _mlp()
    models = {"ddp": ray.train.torch.prepare_model(copy.deepcopy(net), parallel_strategy_kwargs=KWARGS),
              "overlap_ddp": prepare_model(copy.deepcopy(net), parallel_strategy_kwargs=KWARGS)}
    optimizers = {name: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for name, m in models.items()}
    start = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as folder:
            state = torch.load(Path(folder) / "state.pt", weights_only=False)
        for name, model in models.items():
            model.module.load_state_dict(state["models"][name])
            optimizers[name].load_state_dict(state["optimizers"][name])
        start = state["step"]
    torch.save({"start": start, "node_ip": ray.util.get_node_ip_address(),
                "node_rank": context.get_node_rank(),
                "wrappers": {name: type(m).__name__ for name, m in models.items()},
                "unwrapped": type(prepare_model(_mlp(), parallel_strategy=None)).__name__,
                "bucket_bytes_cap": {name: m.bucket_bytes_cap for name, m in models.items()},
                "state_dict_keys": {name: sorted(m.state_dict()) for name, m in models.items()}},
               out / f"start_r{rank}_{attempt}.pt")
    for step in range(start, STEPS):
        grads: dict[str, list[np.ndarray]] = {name: [] for name in models}
        for micro in range(ACCUMULATE):
            inputs, targets = _batch(rank, step, micro)
            for name, model in models.items():
                with model.no_sync() if micro < ACCUMULATE - 1 else nullcontext():
                    nn.functional.mse_loss(model(inputs), targets).backward()
                grads[name].append(_flat(p.grad for p in model.parameters()))  # unreduced after no_sync
        for optimizer in optimizers.values():
            optimizer.step()
            optimizer.zero_grad()
        record = {"grads": grads, "params": {name: _flat(m.parameters()) for name, m in models.items()}}
        torch.save(record, out / f"step_r{rank}_{step}_{attempt}.pt")
        if attempt == 1 and step >= FAIL_AT:
            continue  # past the last checkpoint: these steps are redone after the restart
        state = {"step": step + 1, "models": {name: m.module.state_dict() for name, m in models.items()},
                 "optimizers": {name: o.state_dict() for name, o in optimizers.items()}}
        with tempfile.TemporaryDirectory() as folder:
            saved = None
            if rank == 0:
                torch.save(state, Path(folder) / "state.pt")
                saved = ray.train.Checkpoint.from_directory(folder)
            ray.train.report({"step": step + 1}, checkpoint=saved)
    if attempt == 1 and rank == 1:
        _wait_until_registered(Path(config["snapshot"]), FAIL_AT)
        os._exit(1)  # a worker process dies, as on a lost machine


def _wait_until_registered(snapshot: Path, step: int, timeout_s: float = 120) -> None:
    """Until Ray's controller has registered the checkpoint of ``step`` (it polls the workers' reports,
    so a worker dying just after ``report`` can be faster); its checkpoint manager then writes this file."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            latest = json.loads(snapshot.read_text())["latest_checkpoint_result"]
            if latest and latest["metrics"]["step"] == step:
                return
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.1)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Any:
    import ray

    logs = tmp_path_factory.mktemp("ray_logs")
    python_path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    nodes = RayCluster(logs, python_path)
    previous = {name: os.environ.get(name) for name in RAY_TRAIN_ENV}
    os.environ.update(RAY_TRAIN_ENV)  # the driver's; Ray Train hands them to its controller and workers
    try:
        try:
            nodes.start()
            ray.init(address=nodes.address, _node_ip_address=HEAD_IP, log_to_driver=False)
            nodes.wait_for_nodes(lambda: sum(node["Alive"] for node in ray.nodes()))
        except Exception as error:
            pytest.skip(f"a two-node Ray cluster could not start here: {error}")
        yield ray
    finally:
        ray.shutdown()
        nodes.stop()
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name)
            else:
                os.environ[name] = value


@pytest.fixture(scope="module")
def run(cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One TorchTrainer run, two workers, one failure; what each worker wrote."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    tmp = tmp_path_factory.mktemp("ray_run")
    out, storage = tmp / "records", tmp / "storage"
    out.mkdir()
    snapshot = storage / "run" / "checkpoint_manager_snapshot.json"
    trainer = TorchTrainer(
        _train, train_loop_config={"out": str(out), "snapshot": str(snapshot)},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False, placement_strategy="STRICT_SPREAD"),
        run_config=RunConfig(name="run", storage_path=str(storage), failure_config=FailureConfig(max_failures=1)),
    )
    result = trainer.fit()
    load = lambda path: torch.load(path, weights_only=False)  # noqa: E731
    starts = {rank: [load(p) for p in sorted(out.glob(f"start_r{rank}_*.pt"))] for rank in range(2)}
    steps = {rank: {(int(p.stem.split("_")[2]), int(p.stem.split("_")[3])): load(p)
                    for p in out.glob(f"step_r{rank}_*.pt")} for rank in range(2)}
    return {"starts": starts, "steps": steps, "error": result.error,
            "last_step": result.metrics.get("step") if result.metrics else None}


def _assert_equal(a: np.ndarray, b: np.ndarray, what: str) -> None:
    a, b = torch.from_numpy(a), torch.from_numpy(b)
    assert torch.equal(a, b), f"{what}: max |diff| {(a - b).abs().max()}"


def test_prepare_model_is_bit_equal_to_rays_ddp_after_every_step_with_no_sync_accumulation(run):
    assert run["error"] is None and run["last_step"] == STEPS
    for rank in range(2):
        for start in run["starts"][rank]:
            assert start["wrappers"] == {"ddp": "DistributedDataParallel", "overlap_ddp": "OverlapDDP"}
            assert start["unwrapped"] == "Sequential"  # parallel_strategy=None: no wrap, as with Ray's
            # parallel_strategy_kwargs reached both wrappers (bit-equality alone would not show it here)
            cap = int(KWARGS["bucket_cap_mb"] * 1024 * 1024)
            assert start["bucket_bytes_cap"] == {"ddp": cap, "overlap_ddp": cap}
            assert start["state_dict_keys"]["overlap_ddp"] == start["state_dict_keys"]["ddp"]
        assert len(run["steps"][rank]) == STEPS + (STEPS - FAIL_AT)
        for (step, attempt), record in run["steps"][rank].items():
            where = f"rank {rank} step {step} attempt {attempt}"
            _assert_equal(record["params"]["overlap_ddp"], record["params"]["ddp"], where)
            grads = zip(record["grads"]["overlap_ddp"], record["grads"]["ddp"], strict=True)
            for micro, (ours, theirs) in enumerate(grads):
                _assert_equal(ours, theirs, f"{where} micro-batch {micro} gradients")


def test_a_worker_killed_once_resumes_from_the_reported_checkpoint_bit_exactly(run):
    for rank in range(2):
        assert [start["start"] for start in run["starts"][rank]] == [0, FAIL_AT]  # restarted from the checkpoint
        for step in range(FAIL_AT, STEPS):
            resumed, uninterrupted = run["steps"][rank][step, 2], run["steps"][rank][step, 1]
            for name in ("ddp", "overlap_ddp"):
                _assert_equal(resumed["params"][name], uninterrupted["params"][name], f"{name} rank {rank} step {step}")


def test_the_two_workers_ran_on_two_nodes(run):
    for attempt in range(2):
        starts = [run["starts"][rank][attempt] for rank in range(2)]
        assert {start["node_ip"] for start in starts} == {HEAD_IP, SECOND_IP}
        assert {start["node_rank"] for start in starts} == {0, 1}


def test_prepare_model_refuses_fsdp_and_unknown_arguments_by_name():
    from overlapddp.integrations.ray import prepare_model

    with pytest.raises(ValueError, match=r"parallel_strategy='fsdp' is not supported.*ray.train.torch.prepare_model"):
        prepare_model(_mlp(), parallel_strategy="fsdp")
    with pytest.raises(TypeError, match=r"parallel_strategy_kwargs has 'bucket_size', which is not an argument"):
        prepare_model(_mlp(), parallel_strategy_kwargs={"bucket_size": 10})
    with pytest.raises(TypeError, match=r"parallel_strategy_kwargs must be a dict"):
        prepare_model(_mlp(), parallel_strategy_kwargs=[("bucket_cap_mb", 1)])
