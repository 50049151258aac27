"""overlapddp.integrations.ray: Ray Train's prepare_model with OverlapDDP, bit-equal to Ray's own DDP.

One Ray cluster for the module, two nodes on this machine (``tests/ray_cluster.py``), one CPU each;
every ``TorchTrainer`` runs two gloo workers, one per node. Each training function builds the same
network twice, once with Ray's ``prepare_model`` (DDP) and once with ours, trains both on the same
rank-dependent batches with gradient accumulation through ``no_sync``, reports a checkpoint with
``ray.train.report`` after every optimizer step, and writes both models' parameters and gradients
after every step to a folder the tests read. A second run kills one worker once; Ray's failure
handling restarts the group from the last checkpoint, and the rerun steps must equal the first run's.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import tempfile
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from tests.ray_cluster import HEAD_IP, SECOND_IP, RayCluster

REPO = Path(__file__).resolve().parent.parent
STEPS, ACCUMULATE, FAIL_AT = 4, 2, 2  # optimizer steps, micro-batches per step, the step a worker dies at
KWARGS = {"bucket_cap_mb": 0.001}  # several buckets

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
    """Ray's DDP and OverlapDDP side by side; a checkpoint per step; optionally one worker dies once."""
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
    torch.save({"start": start, "node_ip": ray.util.get_node_ip_address(), "node_rank": context.get_node_rank(),
                "wrappers": {name: type(m).__name__ for name, m in models.items()},
                "unwrapped": type(prepare_model(_mlp(), parallel_strategy=None)).__name__,
                "state_dict_keys": {name: sorted(m.state_dict()) for name, m in models.items()}},
               out / f"start_r{rank}_{attempt}.pt")
    for step in range(start, STEPS):
        if config.get("fail") and step == FAIL_AT and rank == 1 and attempt == 1:
            os._exit(1)  # a worker process dies, as on a lost machine
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
        record = {"attempt": attempt, "grads": grads,
                  "params": {name: _flat(m.parameters()) for name, m in models.items()}}
        torch.save(record, out / f"step_r{rank}_{step}.pt")
        state = {"step": step + 1, "models": {name: m.module.state_dict() for name, m in models.items()},
                 "optimizers": {name: o.state_dict() for name, o in optimizers.items()}}
        with tempfile.TemporaryDirectory() as folder:
            saved = None
            if rank == 0:
                torch.save(state, Path(folder) / "state.pt")
                saved = ray.train.Checkpoint.from_directory(folder)
            ray.train.report({"step": step + 1}, checkpoint=saved)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Any:
    import ray

    logs = tmp_path_factory.mktemp("ray_logs")
    python_path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    nodes = RayCluster(logs, python_path)
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


def _fit(tmp: Path, name: str, fail: bool) -> dict[str, Any]:
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    out = tmp / name
    out.mkdir()
    trainer = TorchTrainer(
        _train, train_loop_config={"out": str(out), "fail": fail},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False, placement_strategy="STRICT_SPREAD"),
        run_config=RunConfig(name=name, storage_path=str(tmp / "storage"),
                             failure_config=FailureConfig(max_failures=1 if fail else 0)),
    )
    result = trainer.fit()
    starts = {rank: [torch.load(p, weights_only=False) for p in sorted(out.glob(f"start_r{rank}_*.pt"))]
              for rank in range(2)}
    steps = {rank: [torch.load(out / f"step_r{rank}_{step}.pt", weights_only=False) for step in range(STEPS)]
             for rank in range(2)}
    return {"starts": starts, "steps": steps, "error": result.error,
            "checkpoint_step": result.metrics.get("step") if result.metrics else None}


@pytest.fixture(scope="module")
def runs(cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("ray_runs")
    return {"plain": _fit(tmp, "plain", fail=False), "failure": _fit(tmp, "failure", fail=True)}


def _assert_equal(a: np.ndarray, b: np.ndarray, what: str) -> None:
    a, b = torch.from_numpy(a), torch.from_numpy(b)
    assert torch.equal(a, b), f"{what}: max |diff| {(a - b).abs().max()}"


def test_prepare_model_is_bit_equal_to_rays_ddp_after_every_step_with_no_sync_accumulation(runs):
    run = runs["plain"]
    assert run["error"] is None and run["checkpoint_step"] == STEPS
    for rank in range(2):
        (start,) = run["starts"][rank]
        assert start["wrappers"] == {"ddp": "DistributedDataParallel", "overlap_ddp": "OverlapDDP"}
        assert start["unwrapped"] == "Sequential"  # parallel_strategy=None: no wrap, as with Ray's
        assert start["state_dict_keys"]["overlap_ddp"] == start["state_dict_keys"]["ddp"]
        for step, record in enumerate(run["steps"][rank]):
            _assert_equal(record["params"]["overlap_ddp"], record["params"]["ddp"], f"rank {rank} step {step}")
            for micro, (ours, theirs) in enumerate(zip(record["grads"]["overlap_ddp"], record["grads"]["ddp"])):
                _assert_equal(ours, theirs, f"rank {rank} step {step} micro-batch {micro} gradients")


def test_a_worker_killed_once_resumes_from_the_reported_checkpoint_bit_exactly(runs):
    plain, failed = runs["plain"], runs["failure"]
    assert failed["error"] is None and failed["checkpoint_step"] == STEPS
    for rank in range(2):
        first, second = failed["starts"][rank]  # the group was started twice
        assert first["start"] == 0 and 0 < second["start"] <= FAIL_AT, (first["start"], second["start"])
        for step in range(STEPS):
            record, reference = failed["steps"][rank][step], plain["steps"][rank][step]
            assert record["attempt"] == (2 if step >= second["start"] else 1)
            for name in ("ddp", "overlap_ddp"):
                _assert_equal(record["params"][name], reference["params"][name], f"{name} rank {rank} step {step}")
            _assert_equal(record["params"]["overlap_ddp"], record["params"]["ddp"], f"rank {rank} step {step}")


def test_the_two_workers_ran_on_two_nodes(runs):
    starts = runs["plain"]["starts"]
    assert {starts[rank][0]["node_ip"] for rank in range(2)} == {HEAD_IP, SECOND_IP}
    assert {starts[rank][0]["node_rank"] for rank in range(2)} == {0, 1}


def test_prepare_model_refuses_fsdp_and_unknown_arguments_by_name():
    from overlapddp.integrations.ray import prepare_model

    with pytest.raises(ValueError, match=r"parallel_strategy='fsdp' is not supported.*ray.train.torch.prepare_model"):
        prepare_model(_mlp(), parallel_strategy="fsdp")
    with pytest.raises(TypeError, match=r"parallel_strategy_kwargs has 'bucket_size', which is not an argument"):
        prepare_model(_mlp(), parallel_strategy_kwargs={"bucket_size": 10})
    with pytest.raises(TypeError, match=r"parallel_strategy_kwargs must be a dict"):
        prepare_model(_mlp(), parallel_strategy_kwargs=[("bucket_cap_mb", 1)])
