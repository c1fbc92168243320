"""Benchmarks that produce rows beside the model results: collective settings (`collectives`)."""
