"""portharness: run Hugging Face models on CPU and a target backend, compare numerics, record and report."""

__version__ = "0.1.0"
