"""Framework integrations: OverlapDDP where a framework builds DistributedDataParallel itself.

The top layer of the package: only users import these modules (each needs its framework
installed), and nothing else in ``overlapddp`` imports them.

- ``overlapddp.integrations.lightning``: ``Trainer(strategy="overlap_ddp")``.
- ``overlapddp.integrations.accelerate``: ``use_overlapddp(accelerator)``.
- ``overlapddp.integrations.transformers``: ``OverlapDDPTrainer``, a ``transformers.Trainer``.
"""
