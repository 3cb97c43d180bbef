"""Shared helpers: user-facing errors, atomic file writes, logging."""
