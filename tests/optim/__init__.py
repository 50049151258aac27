"""Tests of the guard and the overlapped optimizer (overlapddp/optim)."""
