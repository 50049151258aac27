"""How is one bucket reduced, start to end? Private: no API promise (see ``overlapddp``'s docstring).

- ``pipeline.py``: one bucket's life: fill, launch, complete, hand to its consumer.
- ``consumer.py``: who takes a reduced bucket (the copy into ``param.grad``, an optimizer's update).
- ``storage.py``: the flat buffer and its per-parameter views; ``sparse_storage.py``: a sparse gradient.
- ``reduction.py``: what the collective does and divides by (the scaled sum, or a comm hook).
- ``comm_hook.py``: the ``GradBucket``-compatible adapter torch's hooks receive; ``comm_hook_validation.py``.
- ``gradient_checks.py``: gradients written while their bucket reduced; non-finite gradients.
- ``token_weighting.py``: the global token count a bucket divides by under ``count_tokens``.
"""
