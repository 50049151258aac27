"""Which gradients go together, and which layout is in force? Private: no API promise.

- ``plan.py``: parameters in, an immutable bucket plan out (DDP's caps, its rebuild in ready order).
- ``lifecycle.py``: which layout is in force (initial, DDP's rebuild, tuning, final).
- ``tuner.py``: ``bucket_plan="tuned"``: measures calibration iterations from the fence's stamps, asks
  the cost model, runs the selection.
- ``cost_model.py``: a layout from measured ready times, link and post-reduction work (pure).
- ``selection.py``: run each candidate layout a few iterations and keep the fastest (agreed).
"""
