"""The sparse-KV options of dLLM-Serve's Reuse steps (ratio, pooling kernel, selection rule) and their defaults:
torch-free, so the engine's configuration (and the command line built from it) reads them without loading torch;
tandem.engine.diffusion.sparse_kv applies them."""
from __future__ import annotations

from dataclasses import dataclass

SELECTIONS = ("head", "uniform")  # per KV head (dLLM-Serve) or one shared set (Sparse-dLLM); the first is the default
DEFAULT_RETENTION = 0.5          # dLLM-Serve's and Sparse-dLLM's retention ratio
DEFAULT_POOL_KERNEL = 3          # dLLM-Serve's max-pool kernel


@dataclass(frozen=True)
class SparseKVConfig:
    """Which cached positions a Reuse step reads: the retention ratio, the pooling kernel, the selection rule."""

    kv_retention_ratio: float = DEFAULT_RETENTION
    kv_pool_kernel: int = DEFAULT_POOL_KERNEL
    kv_selection: str = SELECTIONS[0]

    def __post_init__(self) -> None:
        """Validate every option, naming it."""
        r, k = self.kv_retention_ratio, self.kv_pool_kernel
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0.0 < float(r) <= 1.0:
            raise ValueError(f"kv_retention_ratio must be a number in (0, 1], got {r!r}")
        if isinstance(k, bool) or not isinstance(k, int) or k < 1 or k % 2 == 0:
            raise ValueError(f"kv_pool_kernel must be an odd integer >= 1, got {k!r}")
        if self.kv_selection not in SELECTIONS:
            raise ValueError(f"kv_selection must be one of {', '.join(SELECTIONS)}, got {self.kv_selection!r}")

    def num_keep(self, num_cached: int) -> int:
        """Positions kept per head out of `num_cached`: ⌊ρ·L⌋, at least 1 (0 when nothing is cached)."""
        if num_cached <= 0:
            return 0
        return min(num_cached, max(1, int(self.kv_retention_ratio * num_cached + 1e-9)))
