"""Which bucket layout is fastest here? ``bucket_plan="tuned"``, in one place.

- ``clock.py``: when did it happen (the host clock on CPU, CUDA events on GPUs); the fence's log
  uses it too.
- ``cost_model.py``: a layout from measured ready times, link and post-reduction work (pure).
- ``selection.py``: run each candidate layout a few iterations and keep the fastest (agreed).
- ``tuner.py``: the stateful driver: measures calibration iterations, asks the cost model, runs the
  selection; driven by the reducer's layout lifecycle, which hands it to the reducer for one
  iteration at a time to report timings.
"""
