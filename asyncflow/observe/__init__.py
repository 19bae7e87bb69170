"""Observability: progress bar, per-role busy fractions, run summaries."""
