"""MemoryKit benchmark cases (technique layer applied to the benchmark model's diffusion model)."""
from __future__ import annotations

MEMORYKIT: list = []
