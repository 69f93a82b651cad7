"""MemoryKit benchmarks: ``python -m benchmarks.run`` (see run.py)."""
