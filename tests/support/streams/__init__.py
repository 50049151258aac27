"""A stream race detector that runs the library's CUDA path on CPU tensors.

``sim.py`` has the fake streams and events (vector clocks), host memory (pageable, pinned) and the
host's clock, the dispatch mode and patches that record every read and write of every storage, and
the allocator rule. ``backends.py`` models what NCCL (and gloo's worker thread) does with a
collective's tensors, streams and futures, and what the autograd engine does with streams, each
rule with the torch source it models. ``scenarios.py`` drives ``OverlapDDP`` through its public API
on every CUDA path; ``coverage.py`` says which lines are the CUDA path and traces which ran;
``sites.py`` finds the call sites ``tools/stream_mutations.py`` changes one at a time.
"""
