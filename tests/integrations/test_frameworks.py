"""overlapddp.integrations: Lightning, Accelerate and the transformers Trainer, each bit-equal to its own DDP.

One spawn of two gloo ranks runs every framework's scenarios twice, once with the framework's DDP
and once with OverlapDDP, and records the flat parameters after every batch; the tests below compare
them with ``torch.equal``. The ranks look to the frameworks as if torchrun had started them
(``_as_if_torchrun``), so each framework reuses the process group ``run_ranks`` set up. A framework
that is not installed is skipped with the reason; the ``integrations`` extra installs all three.
"""

from __future__ import annotations

import importlib.util
import os
import traceback
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.support.multiprocess import run_ranks

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "frameworks.md"
FRAMEWORKS = ("lightning", "fabric", "pytorch_lightning", "accelerate", "transformers")
PACKAGES = {"fabric": "lightning"}  # the package each framework's scenarios import
WORLD_SIZE = 2


def _installed(framework: str) -> bool:
    return importlib.util.find_spec(PACKAGES.get(framework, framework)) is not None


def _as_if_torchrun(rank: int, world_size: int) -> None:
    """The environment torchrun gives a rank: Lightning and Accelerate read it (the group exists already)."""
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size), TORCHELASTIC_RUN_ID="overlapddp-tests", MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29500", CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
    )


def _flat(module: nn.Module) -> np.ndarray:
    """Every parameter, flattened; as an array, which a rank can return after its process is gone."""
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()]).numpy().copy()


def _error_of(action: Callable[[], Any]) -> str:
    """``"TypeName: message"`` of what ``action`` raises; "" when it raises nothing."""
    try:
        action()
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return ""


def _regression_data(samples: int = 32) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(samples, 16, generator=generator)
    return TensorDataset(inputs, inputs.sum(dim=1, keepdim=True).sin())


def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))


# -- Lightning ---------------------------------------------------------------------------------


def _lightning(tmp: Path) -> dict[str, Any]:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy

    from overlapddp.integrations.lightning import OverlapDDPStrategy

    return _trainer(tmp, pl, DDPStrategy, OverlapDDPStrategy)


def _pytorch_lightning(tmp: Path) -> dict[str, Any]:
    """The standalone package: its own Trainer, DDPStrategy and registry, the same scenarios."""
    import pytorch_lightning as pl
    from pytorch_lightning.strategies import DDPStrategy

    from overlapddp.integrations.pytorch_lightning import OverlapDDPStrategy

    return _trainer(tmp / "pytorch_lightning", pl, DDPStrategy, OverlapDDPStrategy)


def _trainer(tmp: Path, pl: Any, DDPStrategy: type, OverlapDDPStrategy: type) -> dict[str, Any]:  # noqa: C901 - one scenario per Trainer feature
    """A Lightning Trainer (``pl``: ``lightning.pytorch`` or ``pytorch_lightning``) with DDP and with OverlapDDP."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    tmp.mkdir(exist_ok=True)

    class Regressor(pl.LightningModule):
        """Automatic or manual optimization; manual runs two backward passes per forward, as a GAN does."""

        def __init__(self, manual: bool = False, unused: bool = False, accumulate_manually: bool = False) -> None:
            super().__init__()
            self.net = _mlp()
            self.unused = nn.Linear(4, 4) if unused else None
            self.automatic_optimization = not manual
            self.accumulate_manually = accumulate_manually

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            inputs, targets = batch
            if self.automatic_optimization:
                return nn.functional.mse_loss(self.net(inputs), targets)
            optimizer = self.optimizers()
            if self.accumulate_manually:  # Lightning's recipe: the first half's backward is not reduced
                for half, sync in ((slice(0, 2), False), (slice(2, 4), True)):
                    with optimizer.toggle_model(sync_grad=sync):
                        self.manual_backward(nn.functional.mse_loss(self.net(inputs[half]), targets[half]))
                optimizer.step()
                optimizer.zero_grad()
                return None
            for half in (slice(0, 2), slice(2, 4)):
                self.manual_backward(nn.functional.mse_loss(self.net(inputs[half]), targets[half]))
                optimizer.step()
                optimizer.zero_grad()
            return None

        def test_step(self, batch: Any, batch_idx: int) -> None:
            inputs, targets = batch
            self.log("test_loss", nn.functional.mse_loss(self.net(inputs), targets), sync_dist=True)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    class Record(pl.Callback):
        def __init__(self) -> None:
            self.params: list[np.ndarray] = []
            self.wrappers: set[str] = set()

        def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
            self.params.append(_flat(module))
            self.wrappers.add(type(trainer.strategy.model).__name__)

    loader = DataLoader(_regression_data(), batch_size=4)

    def fit(strategy: Any, steps: int, **options: Any) -> tuple[Regressor, pl.Trainer, Record]:
        pl.seed_everything(0, verbose=False)
        model = Regressor(manual=options.pop("manual", False), unused=options.pop("unused", False),
                          accumulate_manually=options.pop("accumulate_manually", False))
        record = Record()
        callbacks = [record, *options.pop("callbacks", [])]
        trainer = pl.Trainer(
            accelerator="cpu", devices=WORLD_SIZE, strategy=strategy, max_steps=steps, callbacks=callbacks,
            accumulate_grad_batches=options.pop("accumulate", 1), logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        )
        trainer.fit(model, loader, **options)
        return model, trainer, record

    def by_name(name: str) -> dict[str, Any]:
        """Accumulation, trainer.test() after fit(), a checkpoint and a resume from it."""
        model, trainer, record = fit(name, steps=3, accumulate=2)
        unwrapped = trainer.strategy.model is model
        checkpoint = tmp / f"lightning_{name}.ckpt"
        trainer.save_checkpoint(checkpoint)
        (tested,) = trainer.test(model, loader, verbose=False)
        _, _, resumed = fit(name, steps=5, accumulate=2, ckpt_path=checkpoint)
        keys = sorted(torch.load(checkpoint, weights_only=False)["state_dict"])
        return {"params": record.params, "wrappers": record.wrappers, "unwrapped_after_fit": unwrapped,
                "test_loss": tested["test_loss"], "checkpoint_keys": keys, "resumed": resumed.params}

    def with_arguments(strategy_class: type) -> dict[str, Any]:
        """DDP's arguments pass through: an unused parameter needs find_unused_parameters."""
        strategy = strategy_class(bucket_cap_mb=0.001, find_unused_parameters=True)
        model, trainer, record = fit(strategy, steps=2, accumulate=2, unused=True)
        return {"params": record.params, "wrappers": record.wrappers}

    def manual(name: str) -> dict[str, Any]:
        _, _, record = fit(name, steps=6, manual=True)  # two optimizer steps per batch
        return {"params": record.params, "wrappers": record.wrappers}

    def manual_accumulate(name: str) -> dict[str, Any]:
        """toggle_model(sync_grad=False) for the first of two backward passes, then one step. Each
        wrapper gets the same counting all-reduce hook (at 2 ranks its division is DDP's scaling,
        bit for bit), so the reductions per batch are counted for DDP and OverlapDDP alike."""
        reduced: list[int] = []

        def counting(state, bucket):  # unannotated: DDP rejects the string annotations of this module
            reduced.append(bucket.index())
            return default_hooks.allreduce_hook(state, bucket)

        class CountReductions(pl.Callback):
            def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
                trainer.strategy.model.register_comm_hook(dist.group.WORLD, counting)

        _, _, record = fit(name, steps=3, manual=True, accumulate_manually=True, callbacks=[CountReductions()])
        return {"params": record.params, "wrappers": record.wrappers, "reductions": len(reduced)}

    hook_calls = []

    def counting_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        hook_calls.append(bucket.index())
        return default_hooks.allreduce_hook(state, bucket)

    results = {
        "by_name": {"ddp": by_name("ddp"), "overlap_ddp": by_name("overlap_ddp")},
        "with_arguments": {"ddp": with_arguments(DDPStrategy), "overlap_ddp": with_arguments(OverlapDDPStrategy)},
        "manual": {"ddp": manual("ddp"), "overlap_ddp": manual("overlap_ddp")},
        "manual_accumulate": {"ddp": manual_accumulate("ddp"), "overlap_ddp": manual_accumulate("overlap_ddp")},
    }
    fit(OverlapDDPStrategy(ddp_comm_hook=counting_hook, bucket_cap_mb=0.001), steps=2)
    refused = _error_of(lambda: fit(OverlapDDPStrategy(static_graph=True), steps=1, manual=True))
    return {**results, "comm_hook_buckets": sorted(set(hook_calls)), "manual_static_graph": refused}


# -- Lightning Fabric ----------------------------------------------------------------------------


def _grads(module: nn.Module) -> np.ndarray:
    return torch.cat([p.grad.reshape(-1) for p in module.parameters() if p.grad is not None]).numpy().copy()


class _WithUnusedLayer(nn.Module):
    """A layer the forward never uses: DDP and OverlapDDP need find_unused_parameters=True for it."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _mlp()
        self.unused = nn.Linear(4, 4)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.net(inputs)


def _fabric(tmp: Path) -> dict[str, Any]:
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy

    import overlapddp.integrations.lightning  # noqa: F401  (registers "overlap_ddp" with Fabric too)
    from overlapddp.integrations.lightning import OverlapDDPFabricStrategy

    def train(strategy: Any, name: str, unused: bool = False) -> dict[str, Any]:
        """3 steps of 2 batches through no_backward_sync, fabric.save, a step, fabric.load, that step again."""
        fabric = Fabric(accelerator="cpu", devices=WORLD_SIZE, strategy=strategy)
        fabric.launch()
        torch.manual_seed(0)
        net = _WithUnusedLayer() if unused else _mlp()
        model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
        loader = fabric.setup_dataloaders(DataLoader(_regression_data(64), batch_size=4))  # rank-dependent batches
        batches = list(loader)
        params, grads = [], []

        def steps(micro_batches: list[Any]) -> None:
            for index, (inputs, targets) in enumerate(micro_batches):
                with fabric.no_backward_sync(model, enabled=index % 2 == 0):
                    fabric.backward(nn.functional.mse_loss(model(inputs), targets))
                grads.append(_grads(net))  # after the first of two: this rank's own, not reduced
                if index % 2 == 1:
                    optimizer.step()
                    optimizer.zero_grad()
                params.append(_flat(net))

        steps(batches[:6])
        checkpoint = tmp / f"fabric_{name}.ckpt"
        fabric.save(checkpoint, {"model": model, "optimizer": optimizer})
        saved = _flat(net)
        steps(batches[6:8])
        fabric.load(checkpoint, {"model": model, "optimizer": optimizer})
        restored = _flat(net)
        steps(batches[6:8])
        return {"params": params, "grads": grads, "wrapper": type(model._forward_module).__name__,
                "checkpoint_keys": sorted(torch.load(checkpoint, weights_only=False)["model"]),
                "restored_exactly": np.array_equal(saved, restored)}

    results = {
        "by_name": {"ddp": train("ddp", "ddp"), "overlap_ddp": train("overlap_ddp", "overlap_ddp")},
        "with_arguments": {
            "ddp": train(DDPStrategy(bucket_cap_mb=0.001, find_unused_parameters=True), "ddp_args", unused=True),
            "overlap_ddp": train(OverlapDDPFabricStrategy(bucket_cap_mb=0.001, find_unused_parameters=True),
                                 "overlap_ddp_args", unused=True),
        },
    }
    control = OverlapDDPFabricStrategy()._backward_sync_control
    return {**results, "no_sync_unwrapped": _error_of(lambda: control.no_backward_sync(_mlp(), enabled=True))}


# -- Accelerate --------------------------------------------------------------------------------


def _accelerate(tmp: Path) -> dict[str, Any]:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs

    from overlapddp.integrations.accelerate import use_overlapddp

    def accelerator(overlap: bool, accumulate: int, dynamo_backend: str | None = None, **ddp: Any) -> Accelerator:
        AcceleratorState._reset_state()  # each Accelerator with its own settings, in one process
        GradientState._reset_state()
        made = Accelerator(cpu=True, gradient_accumulation_steps=accumulate, dynamo_backend=dynamo_backend,
                           kwargs_handlers=[DistributedDataParallelKwargs(**ddp)])
        return use_overlapddp(made) if overlap else made

    def prepared(acc: Accelerator) -> tuple[nn.Module, nn.Module, Any, Any]:
        torch.manual_seed(0)
        net = _mlp()
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        model, optimizer, loader = acc.prepare(net, optimizer, DataLoader(_regression_data(64), batch_size=4))
        return net, model, optimizer, loader

    def accumulate_and_checkpoint(overlap: bool) -> dict[str, Any]:
        """accumulate() over 3 steps, save_state, one more step, load_state, that step again."""
        acc = accelerator(overlap, accumulate=2, bucket_cap_mb=0.001)
        net, model, optimizer, loader = prepared(acc)
        batches = list(loader)
        params = []

        def train(micro_batches: list[Any]) -> None:
            for inputs, targets in micro_batches:
                with acc.accumulate(model):
                    acc.backward(nn.functional.mse_loss(model(inputs), targets))
                    optimizer.step()
                    optimizer.zero_grad()
                params.append(_flat(net))

        train(batches[:6])
        checkpoint = tmp / f"accelerate_{overlap}"
        acc.save_state(checkpoint)
        saved = _flat(net)
        train(batches[6:8])
        acc.load_state(checkpoint)
        restored = _flat(net)
        train(batches[6:8])
        return {"params": params, "wrapper": type(model).__name__, "unwrapped": acc.unwrap_model(model) is net,
                "state_dict_keys": sorted(acc.get_state_dict(model)),
                "restored_exactly": np.array_equal(saved, restored)}

    def trigger_sync(overlap: bool) -> dict[str, Any]:
        """Accelerate's trigger_sync_in_backward pattern, with the FP16 comm hook from the kwargs handler."""
        acc = accelerator(overlap, accumulate=1, comm_hook=DDPCommunicationHookType.FP16)
        net, model, optimizer, loader = prepared(acc)
        params = []
        for _step, (inputs, targets) in zip(range(3), loader, strict=False):
            with acc.no_sync(model):
                loss_a = nn.functional.mse_loss(model(inputs[:2]), targets[:2])
                loss_b = nn.functional.mse_loss(model(inputs[2:]), targets[2:])
            acc.backward(loss_a)
            with acc.trigger_sync_in_backward(model):
                acc.backward(loss_b)
            optimizer.step()
            optimizer.zero_grad()
            params.append(_flat(net))
        return {"params": params, "wrapper": type(model).__name__}

    def refusals() -> dict[str, str]:
        """Accelerate's compile setting, and trigger_sync_in_backward without knowing the used parameters."""
        # One at a time: Accelerate keeps its settings in process-wide state.
        compiled = accelerator(True, accumulate=1, dynamo_backend="eager")
        dynamo = _error_of(lambda: compiled.prepare(_mlp()))
        unused = accelerator(True, accumulate=1, find_unused_parameters=True)
        model = unused.prepare(_mlp())
        trigger = _error_of(lambda: unused.trigger_sync_in_backward(model).__enter__())
        return {"dynamo": dynamo, "trigger_unused": trigger}

    return {
        "refusals": refusals(),
        "accumulate": {"ddp": accumulate_and_checkpoint(False), "overlap_ddp": accumulate_and_checkpoint(True)},
        "trigger_sync": {"ddp": trigger_sync(False), "overlap_ddp": trigger_sync(True)},
    }


# -- transformers Trainer ----------------------------------------------------------------------


def _transformers(tmp: Path) -> dict[str, Any]:
    from accelerate.state import AcceleratorState
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from overlapddp.integrations.transformers import OverlapDDPTrainer

    class Record(TrainerCallback):
        def __init__(self) -> None:
            self.params: list[np.ndarray] = []

        def on_step_end(self, args: Any, state: Any, control: Any, model: nn.Module, **kwargs: Any) -> None:
            self.params.append(_flat(model))

    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 64, (32, 16), generator=generator)
    data = [{"input_ids": row, "labels": row} for row in tokens]

    def train(trainer_class: type) -> dict[str, Any]:
        AcceleratorState._reset_state()
        config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        torch.manual_seed(0)
        model = GPT2LMHeadModel(config)
        args = TrainingArguments(
            output_dir=str(tmp / f"trainer_{trainer_class.__name__}"), use_cpu=True, ddp_backend="gloo",
            per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=3, learning_rate=1e-2,
            seed=0, report_to=[], save_strategy="no", logging_strategy="no", dataloader_num_workers=0,
            ddp_bucket_cap_mb=1, disable_tqdm=True,
        )
        record = Record()
        trainer = trainer_class(model=model, args=args, train_dataset=data, callbacks=[record])
        trainer.train()
        return {"params": record.params, "wrapper": type(trainer.model_wrapped).__name__,
                "unwrapped": trainer.accelerator.unwrap_model(trainer.model_wrapped) is model}

    return {"trainer": {"ddp": train(Trainer), "overlap_ddp": train(OverlapDDPTrainer)}}


# -- one spawn for all ---------------------------------------------------------------------------

SCENARIOS: dict[str, Callable[[Path], dict[str, Any]]] = {
    "lightning": _lightning, "fabric": _fabric, "pytorch_lightning": _pytorch_lightning, "accelerate": _accelerate,
    "transformers": _transformers,
}


def _rank(rank: int, world_size: int, frameworks: list[str], tmp: str) -> dict[str, Any]:
    _as_if_torchrun(rank, world_size)
    results: dict[str, Any] = {}
    for name in frameworks:
        try:
            results[name] = SCENARIOS[name](Path(tmp))
        except Exception:
            results[name] = {"error": traceback.format_exc()}
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    installed = [name for name in FRAMEWORKS if _installed(name)]
    if not installed:
        pytest.skip("none of lightning, pytorch_lightning, accelerate, transformers is installed (integrations extra)")
    return run_ranks(WORLD_SIZE, _rank, installed, str(tmp_path_factory.mktemp("frameworks")), pg_timeout_s=60)


def _results(ranks: list[dict[str, Any]], framework: str) -> list[dict[str, Any]]:
    if not _installed(framework):
        pytest.skip(f"{framework} is not installed (python3 -m pip install -e '.[integrations]')")
    found = [rank[framework] for rank in ranks]
    for rank, result in enumerate(found):
        assert "error" not in result, f"rank {rank}:\n{result['error']}"
    return found


def _assert_bit_equal(scenario: dict[str, Any], batches: int, key: str = "params") -> None:
    ours, theirs = scenario["overlap_ddp"][key], scenario["ddp"][key]
    assert len(ours) == len(theirs) == batches, (len(ours), len(theirs), batches)
    for batch, (a, b) in enumerate(zip(ours, theirs, strict=False)):
        a, b = torch.from_numpy(a), torch.from_numpy(b)
        assert torch.equal(a, b), f"parameters differ from DDP's after batch {batch}: max |diff| {(a - b).abs().max()}"


# The Trainer: lightning.pytorch and the standalone pytorch_lightning, the same scenarios.
TRAINERS = pytest.mark.parametrize("package", ["lightning", "pytorch_lightning"])


@TRAINERS
def test_lightning_by_name_is_bit_equal_to_ddp_with_accumulation_test_and_resume(ranks, package):
    for result in _results(ranks, package):
        scenario = result["by_name"]
        assert scenario["overlap_ddp"]["wrappers"] == {"OverlapDDP"}
        assert scenario["ddp"]["wrappers"] == {"DistributedDataParallel"}
        _assert_bit_equal(scenario, batches=6)
        _assert_bit_equal(scenario, batches=4, key="resumed")  # steps 4 and 5 after resuming at step 3
        ours = scenario["overlap_ddp"]
        assert ours["unwrapped_after_fit"] and ours["test_loss"] == scenario["ddp"]["test_loss"]
        assert ours["checkpoint_keys"] == scenario["ddp"]["checkpoint_keys"]
        assert not any(key.startswith("module.") for key in ours["checkpoint_keys"])


@TRAINERS
def test_lightning_passes_ddp_arguments_and_comm_hooks_through(ranks, package):
    for result in _results(ranks, package):
        _assert_bit_equal(result["with_arguments"], batches=4)  # fails without find_unused_parameters
        assert len(result["comm_hook_buckets"]) > 1, "the hook saw one bucket: bucket_cap_mb was not passed"


@TRAINERS
def test_lightning_manual_optimization_reduces_every_backward_as_ddp(ranks, package):
    for result in _results(ranks, package):
        assert result["manual"]["overlap_ddp"]["wrappers"] == {"OverlapDDP"}
        _assert_bit_equal(result["manual"], batches=3)
        assert result["manual_static_graph"].startswith("ValueError: OverlapDDPStrategy(static_graph=True) with manual")


@TRAINERS
def test_lightning_manual_accumulation_under_toggle_model_reduces_once_per_step_as_ddp(ranks, package):
    """toggle_model(sync_grad=False) keeps the first backward local: one reduction per step, as DDP."""
    for result in _results(ranks, package):
        scenario = result["manual_accumulate"]
        assert scenario["overlap_ddp"]["wrappers"] == {"OverlapDDP"}
        assert scenario["ddp"]["reductions"] == 3, scenario["ddp"]["reductions"]  # one bucket, three steps
        assert scenario["overlap_ddp"]["reductions"] == scenario["ddp"]["reductions"]
        _assert_bit_equal(scenario, batches=3)


def test_fabric_by_name_no_backward_sync_save_and_load_are_bit_equal_to_ddp(ranks):
    for result in _results(ranks, "fabric"):
        scenario = result["by_name"]
        ours = scenario["overlap_ddp"]
        assert ours["wrapper"] == "OverlapDDP" and scenario["ddp"]["wrapper"] == "DistributedDataParallel"
        _assert_bit_equal(scenario, batches=10)
        _assert_bit_equal(scenario, batches=10, key="grads")  # fails where no_backward_sync reduces
        assert ours["restored_exactly"] and ours["checkpoint_keys"] == scenario["ddp"]["checkpoint_keys"]
        assert not any(key.startswith("module.") for key in ours["checkpoint_keys"])


def test_fabric_instance_passes_ddp_arguments_and_refuses_no_sync_on_a_bare_module(ranks):
    for result in _results(ranks, "fabric"):
        assert result["with_arguments"]["overlap_ddp"]["wrapper"] == "OverlapDDP"
        _assert_bit_equal(result["with_arguments"], batches=10)  # fails without find_unused_parameters
        assert result["no_sync_unwrapped"].startswith("TypeError: OverlapDDPFabricStrategy.no_backward_sync needs")


def test_accelerate_prepare_accumulate_and_state_round_trip_are_bit_equal_to_ddp(ranks):
    for result in _results(ranks, "accelerate"):
        scenario = result["accumulate"]
        ours = scenario["overlap_ddp"]
        assert ours["wrapper"] == "OverlapDDP" and scenario["ddp"]["wrapper"] == "DistributedDataParallel"
        assert ours["unwrapped"] and ours["restored_exactly"]
        assert ours["state_dict_keys"] == scenario["ddp"]["state_dict_keys"]
        _assert_bit_equal(scenario, batches=10)


def test_accelerate_refuses_its_compile_setting_and_trigger_sync_with_unused_parameter_search(ranks):
    for result in _results(ranks, "accelerate"):
        refused = result["refusals"]
        assert refused["dynamo"].startswith("NotImplementedError: use_overlapddp: Accelerate's torch.compile")
        assert refused["trigger_unused"].startswith("ValueError: Accelerator.trigger_sync_in_backward with find_unused")


def test_accelerate_trigger_sync_in_backward_with_fp16_comm_hook_is_bit_equal_to_ddp(ranks):
    for result in _results(ranks, "accelerate"):
        assert result["trigger_sync"]["overlap_ddp"]["wrapper"] == "OverlapDDP"
        _assert_bit_equal(result["trigger_sync"], batches=3)


def test_transformers_trainer_is_bit_equal_to_its_ddp(ranks):
    for result in _results(ranks, "transformers"):
        scenario = result["trainer"]
        assert scenario["overlap_ddp"]["wrapper"] == "OverlapDDP"
        assert scenario["ddp"]["wrapper"] == "DistributedDataParallel"
        assert scenario["overlap_ddp"]["unwrapped"]
        _assert_bit_equal(scenario, batches=3)


def test_the_frameworks_page_shows_the_tested_one_line_usages():
    text = DOC.read_text()
    for usage in ('strategy="overlap_ddp"', "import overlapddp.integrations.lightning", "Fabric(strategy=",
                  "import overlapddp.integrations.pytorch_lightning", "from overlapddp.integrations.ray import",
                  "use_overlapddp(Accelerator(", "OverlapDDPTrainer("):
        assert usage in text, f"{DOC} no longer shows {usage}"
