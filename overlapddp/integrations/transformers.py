"""Hugging Face transformers: ``OverlapDDPTrainer`` is a ``Trainer`` that trains with OverlapDDP.

::

    from overlapddp.integrations.transformers import OverlapDDPTrainer
    trainer = OverlapDDPTrainer(model=model, args=args, train_dataset=data)   # instead of Trainer

The Trainer builds DDP through its Accelerator (``args.ddp_*`` become Accelerate's
``DistributedDataParallelKwargs``); this subclass switches every Accelerator the Trainer creates
(hyperparameter search creates new ones) to OverlapDDP. To keep another Trainer subclass, list it
second: ``class MyTrainer(OverlapDDPTrainer, SFTTrainer)``.
"""

from __future__ import annotations

from transformers import Trainer

from overlapddp.integrations.accelerate import use_overlapddp


class OverlapDDPTrainer(Trainer):
    """``transformers.Trainer`` whose Accelerator wraps the model in :class:`OverlapDDP` instead of DDP."""

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        use_overlapddp(self.accelerator)
