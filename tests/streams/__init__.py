"""A stream race detector that runs the library's CUDA path on CPU tensors.

``sim.py`` has the fake streams and events (vector clocks), the dispatch mode that records every read
and write of every storage on the current fake stream, and the allocator rule. ``backends.py`` models
what NCCL (and gloo's worker thread) does with a collective's tensors, streams and futures, and what
the autograd engine does with streams. ``scenarios.py`` drives ``OverlapDDP`` through its public API
on every CUDA path; ``tools/stream_mutations.py`` leaves out each wait and ``record_stream`` in turn.
"""
