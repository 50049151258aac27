"""Optimizers over an OverlapDDP's reduced gradients. Private: reached through ``attach_optimizer``.

- ``guard.py``: ``step()`` only reads complete, reduced, fresh gradients.
- ``overlap.py``: each bucket's update as soon as it is reduced (``overlap=True``).
- ``unscaler.py``: a ``GradScaler``'s unscale, bucket by bucket, for the overlapped optimizer.
"""
