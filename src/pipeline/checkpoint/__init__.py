"""Checkpoint pipeline: the checkpoint layout, export/import, verification, the convert-every-checkpoint poller."""
