"""The planner's knobs as `tandem plan` takes them (tandem.knob): the GPU budget, how many deployments to list, how
its simulations run and are cached, and how far it searches; its flags are generated from these fields."""
from __future__ import annotations

import os
from dataclasses import dataclass

from tandem.knob import knob, positive_int

DEFAULT_TOP_K = 3                                     # deployments a plan lists
DEFAULT_JOBS = max(1, min(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1, 8))
"""Simulator processes of a local plan: the CPUs this process may run on (taskset, cgroups), at most 8."""
EXACT_MAX_GPUS = 16                                   # budgets up to this are searched exactly, larger ones by a slice
SLICE_GPUS = 16                                       # the slice's GPUs


@dataclass(slots=True)
class PlanOptions:
    """What `tandem plan` searches and how (None: derived when the plan runs)."""

    gpus: int = knob(help="GPU budget", parse=positive_int, metavar="N")
    top_k: int = knob(DEFAULT_TOP_K, "deployments to list", parse=positive_int, metavar="K", flags=("--top",))
    jobs: int | None = knob(None, f"simulator processes (default: {DEFAULT_JOBS}; with --ray, simulations at once, "
                            "default: the cluster's CPUs)", parse=positive_int)
    cache_dir: str | None = knob(None, "where simulation runs are cached (default: ~/.cache/tandem/plan)",
                                 metavar="DIR")
    no_cache: bool = knob(False, "neither read nor write the run cache")
    exact: bool = knob(False, "simulate every maximal deployment on the full cluster whatever --gpus (default: only "
                       f"up to {EXACT_MAX_GPUS} GPUs; above, a {SLICE_GPUS}-GPU slice shortlists deployments)")
    exhaustive: bool = knob(False, "also simulate every feasible deployment and print both top-K side by side")
