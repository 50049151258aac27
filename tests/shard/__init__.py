"""Tests of the sharded optimizer (overlapddp/shard)."""
