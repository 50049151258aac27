"""Tests of one bucket's life (overlapddp/bucket)."""
