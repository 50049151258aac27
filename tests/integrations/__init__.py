"""Tests of the frameworks (overlapddp/integrations)."""
