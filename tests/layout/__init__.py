"""Tests of which gradients go together, and the tuned plan (overlapddp/layout)."""
