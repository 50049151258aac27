"""Framework integrations: OverlapDDP where a framework builds DistributedDataParallel itself.

The top layer of the package: only users import these modules (each needs its framework
installed), and nothing else in ``overlapddp`` imports them.

- ``overlapddp.integrations.lightning``: ``Trainer(strategy="overlap_ddp")`` and ``Fabric(strategy="overlap_ddp")``.
- ``overlapddp.integrations.pytorch_lightning``: the same Trainer strategy for the standalone package.
- ``overlapddp.integrations.ray``: ``prepare_model``, Ray Train's with OverlapDDP.
- ``overlapddp.integrations.accelerate``: ``use_overlapddp(accelerator)``.
- ``overlapddp.integrations.transformers``: ``OverlapDDPTrainer``, a ``transformers.Trainer``.
- ``overlapddp.integrations.torchft``: ``DistributedDataParallel(manager, module)``, over a torchft ``Manager``.

``trainer_strategy`` (the Trainer strategy's steps, shared by both Lightning packages)
and ``fabric`` are their building blocks.
"""
