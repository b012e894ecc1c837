"""The options of `tandem profile`: what to measure and how (ProfileOptions)."""
from __future__ import annotations

from dataclasses import dataclass

from tandem.perf.step_model import SEGMENTS


@dataclass
class ProfileOptions:
    """What to measure and how (CLI flags of `tandem profile`)."""

    quick: bool = False                 # small grid, sequences up to 1024: a smoke test, not a calibration
    max_len: int | None = None          # cap on sequence length profiled (default: the engine's max_model_len)
    repeats: int | None = None          # timed runs per step (rounds), median taken (default 3)
    device: str = "auto"
    threads: int | None = None          # torch CPU threads (default: torch's own choice)
    max_model_len: int | None = None    # the engine's max_model_len (default: the model's max_position_embeddings);
                                        # on CUDA also the width every CUDA-graphed decode row attends over
    max_num_batched_tokens: int = 2048  # the engine's chunk budget: the largest step measured
    max_num_seqs: int = 256             # the engine's largest decode batch
    block_size: int = 16
    dtype: str = "auto"
    kv_cache_memory_bytes: int | None = None
    num_kv_blocks: int | None = None
    attention_backend: str | None = None
    enforce_eager: bool = False         # CUDA: decode steps eagerly, not as CUDA graphs
    cuda_graph_sizes: tuple[int, ...] | None = None   # CUDA: captured decode batch sizes (None: the default list)
    heldout: int | None = None          # held-out steps (default 40; quick: 16)
    segments: int = SEGMENTS
    seed: int = 0
    point_budget_s: float = 1.0         # stop repeating a step once this much time went into it (>= 2 runs)
    measure_link: bool = True           # measure the KV path between two engines (export, wire, import)
    measure_interference: bool = True   # measure the step slow-down while another engine process steps (CPU)

    @property
    def n_repeats(self) -> int:
        return self.repeats if self.repeats is not None else 3

    @property
    def n_heldout(self) -> int:
        return self.heldout if self.heldout is not None else (16 if self.quick else 40)
