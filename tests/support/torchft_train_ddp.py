"""A torchft training script in the shape of torchft's ``train_ddp.py``: its Manager arguments, its
``Optimizer`` wrapper, its loop (``zero_grad`` starts the quorum, ``step`` commits only if
``should_commit()``), on a small conv net and synthetic data. Written here, with torchft's own DDP;
tests/integrations/test_torchft_script.py runs it as is and with the one import line below swapped for
``from overlapddp.integrations.torchft import DistributedDataParallel``.

Launch (one process per replica group, as torchrun would start it; a lighthouse must be running)::

    TORCHFT_LIGHTHOUSE=http://127.0.0.1:29510 REPLICA_GROUP_ID=0 NUM_REPLICA_GROUPS=2 \\
    MASTER_ADDR=127.0.0.1 MASTER_PORT=29600 RANK=0 WORLD_SIZE=1 python tests/support/torchft_train_ddp.py

Beyond torchft's environment: ``STEPS`` (train until this many committed steps, then exit),
``OUT`` (a folder: the final state and a log of attempts are written there), ``PG_TIMEOUT_S``
(the process group's timeout, 5 s as in torchft's script), and, for the tests only,
``KILL_AT_STEP`` (the replica kills itself once it has committed the step before, so that no
collective of torchft's DDP fails: torchft 0.2.0's DDP stops the survivor with an AssertionError
in its hook when a peer dies with a bucket in flight). The model is seeded per replica group, so
that the Manager's step-0 sync matters.
"""

from __future__ import annotations

import json
import os
import signal
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn, optim
from torch.utils.data import DataLoader, TensorDataset
from torchft import DistributedSampler, Manager, Optimizer, ProcessGroupGloo

# isort: split
# The one line a torchft user swaps for overlapddp's (tests/integrations/test_torchft_script.py does):
from torchft import DistributedDataParallel


class Net(nn.Module):
    """Two convolutions and two linear layers: two buckets at DDP's default caps (the first of
    1 MiB, in registration order, holds the convolutions and the large linear weight)."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1),
                                      nn.ReLU(), nn.Flatten())
        self.head = nn.Sequential(nn.Linear(32 * 8 * 8, 256), nn.ReLU(), nn.Linear(256, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def synthetic_images(count: int = 512) -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    return TensorDataset(torch.randn(count, 3, 8, 8, generator=g), torch.randint(0, 10, (count,), generator=g))


def main() -> None:
    replica_group_id = int(os.environ.get("REPLICA_GROUP_ID", 0))
    num_replica_groups = int(os.environ.get("NUM_REPLICA_GROUPS", 2))
    steps = int(os.environ.get("STEPS", 10))
    out = Path(os.environ["OUT"]) if "OUT" in os.environ else None

    trainset = synthetic_images()
    sampler = DistributedSampler(trainset, replica_rank=replica_group_id, num_replica_groups=num_replica_groups,
                                 group_rank=0, num_replicas=1, shuffle=True)
    trainloader = DataLoader(trainset, batch_size=16, sampler=sampler)

    def load_state_dict(state_dict: dict[str, Any]) -> None:
        m.load_state_dict(state_dict["model"])
        optimizer.load_state_dict(state_dict["optim"])

    def state_dict() -> dict[str, Any]:
        return {"model": m.state_dict(), "optim": optimizer.state_dict()}

    pg = ProcessGroupGloo(timeout=timedelta(seconds=float(os.environ.get("PG_TIMEOUT_S", 5))))
    manager = Manager(
        pg=pg,
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"train_ddp_{replica_group_id}",
        timeout=timedelta(seconds=30),
    )

    torch.manual_seed(replica_group_id)
    m = DistributedDataParallel(manager, Net())
    optimizer = Optimizer(manager, optim.AdamW(m.parameters()))
    criterion = nn.CrossEntropyLoss()
    _plant_kill(optimizer.optim, manager)
    attempts: list[dict[str, Any]] = []

    while True:
        for inputs, labels in trainloader:
            # starts the quorum, which runs during the forward (the Manager's default)
            optimizer.zero_grad()
            loss = criterion(m(inputs), labels)
            loss.backward()  # the buckets are all-reduced through the manager
            before = manager.current_step()
            optimizer.step()  # steps only if manager.should_commit()
            attempts.append({"step": before, "participants": manager.num_participants(),
                             "committed": manager.current_step() > before})
            if manager.current_step() >= steps:
                if out is not None:
                    torch.save(m.state_dict(), out / f"state_{replica_group_id}.pt")
                    (out / f"log_{replica_group_id}.json").write_text(json.dumps(attempts))
                exit()  # the interpreter's own exit, as torchft's script ends


def _plant_kill(inner: optim.Optimizer, manager: Manager) -> None:
    """Tests only: SIGKILL this process once step ``KILL_AT_STEP - 1`` is applied (the optimizer
    steps after ``should_commit()`` counted it), before it asks for the next quorum."""
    if "KILL_AT_STEP" not in os.environ:
        return
    at = int(os.environ["KILL_AT_STEP"])

    def strike(*_: Any) -> None:
        if manager.current_step() == at:
            os.kill(os.getpid(), signal.SIGKILL)

    inner.register_step_post_hook(strike)


if __name__ == "__main__":
    main()
