"""The race detector's tests: its zoo of loops (racy and clean), its CLI, ``--force`` and streams."""
