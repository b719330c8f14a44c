"""A downstream team's own training loops, golden-tested with fpemu's pytest plugin."""
