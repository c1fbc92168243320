"""Stage 4, analysis: pandas views of the store (compatibility matrix, op coverage, night-to-night diff)."""
