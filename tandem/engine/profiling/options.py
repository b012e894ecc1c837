"""The options of `tandem profile`: what to measure and how (ProfileOptions). Each one a user sets is a knob
(tandem.knob), so the command's flags are generated from these fields; the engine's token and sequence budgets are
the scheduler's knobs (tandem.core.config), shared rather than restated."""
from __future__ import annotations

from dataclasses import dataclass

from tandem.core.config import DEFAULT_BLOCK_SIZE, SchedulerConfig
from tandem.engine.config import EngineConfig
from tandem.knob import csv_list, knob, positive_int, seed, shared
from tandem.perf.step_model import SEGMENTS

DEFAULT_REPEATS = 3            # timed runs of every step (the median is kept)
DEFAULT_HELDOUT = 40           # random held-out steps of the error estimate
QUICK_HELDOUT = 16             # ... of a --quick profile
QUICK_MAX_LEN = 1024           # the longest sequence of a --quick profile
DTYPES = ("auto", "float32", "float16", "bfloat16")


def graph_sizes(text: str) -> tuple[int, ...]:
    """--cuda-graph-sizes: a comma-separated list of decode batch sizes >= 1."""
    return tuple(csv_list(positive_int)(text))


@dataclass
class ProfileOptions:
    """What to measure and how (the flags of `tandem profile`)."""

    quick: bool = knob(False, f"a small grid with sequences up to {QUICK_MAX_LEN} tokens (seconds on a tiny model): "
                       "checks the pipeline, it does not calibrate")
    max_len: int | None = knob(None, "longest sequence profiled (default: the model's context, within the KV pool)",
                               parse=positive_int, metavar="N")
    repeats: int | None = knob(None, f"timed runs of every step; the median is kept (default: {DEFAULT_REPEATS})",
                               parse=positive_int, metavar="K")
    device: str = knob("auto", "auto, cpu, cuda or cuda:N")
    threads: int | None = knob(None, "torch CPU threads (default: torch's; profile with what the server will use)",
                               parse=positive_int, metavar="N")
    max_model_len: int | None = None    # the engine's max_model_len (default: the model's max_position_embeddings);
                                        # on CUDA also the width every CUDA-graphed decode row attends over
    dtype: str = knob("auto", "compute dtype", choices=DTYPES)
    tensor_parallel_size: int = shared(EngineConfig, "tensor_parallel_size")   # the profiled engine's ranks
    max_num_batched_tokens: int = shared(SchedulerConfig, "max_num_batched_tokens")   # also the largest step measured
    max_num_seqs: int = shared(SchedulerConfig, "max_num_seqs")                       # the largest decode batch
    block_size: int = DEFAULT_BLOCK_SIZE
    kv_cache_memory_bytes: int | None = None
    num_kv_blocks: int | None = knob(None, "KV pool size in blocks (default: the engine's memory budget)",
                                     parse=positive_int, metavar="N")
    attention_backend: str | None = None
    enforce_eager: bool = knob(False, "CUDA: time decode steps eagerly (no CUDA graphs)")
    cuda_graph_sizes: tuple[int, ...] | None = knob(None, "CUDA: decode batch sizes captured as CUDA graphs (default: "
                                                    "vLLM's 1,2,4,8,16,... up to max-num-seqs and vLLM's cap)",
                                                    parse=graph_sizes, metavar="1,2,4,8")
    heldout: int | None = knob(None, f"random held-out steps for the error estimate (default: {DEFAULT_HELDOUT}; "
                               f"--quick: {QUICK_HELDOUT})", parse=positive_int, metavar="N")
    segments: int = SEGMENTS
    seed: int = knob(0, "seed of the grids and tokens", parse=seed)
    point_budget_s: float = 1.0         # stop repeating a step once this much time went into it (>= 2 runs)
    measure_link: bool = True           # measure the KV path between two engines (export, wire, import)
    measure_interference: bool = True   # measure the step slow-down while another engine process steps (CPU)
    measure_collective: bool = True     # time all-reduces among this host's CPU ranks (tandem.perf.collective)

    @property
    def n_repeats(self) -> int:
        """Timed runs of every step."""
        return self.repeats if self.repeats is not None else DEFAULT_REPEATS

    @property
    def n_heldout(self) -> int:
        """Held-out steps of the error estimate."""
        return self.heldout if self.heldout is not None else (QUICK_HELDOUT if self.quick else DEFAULT_HELDOUT)
