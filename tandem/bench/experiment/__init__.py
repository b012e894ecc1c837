"""Experiment sweeps (AMPD §7): workloads x policies x arrival rates, each policy on its best deployment.

For every (workload, policy) the deployment is chosen by a small search (see `deployment_candidates`):
every candidate is simulated at the reference rate (the median of the rates, the upper one when their
number is even) and scored by SLO attainment, ties broken by lower TTFT p95 (all rounds), then by
candidate order. The chosen deployment then runs at every rate (the search run at the reference rate
is reused as that cell). This mirrors the paper's protocol: AMPD's deployment comes from its planner,
the baselines' are tuned and their best is reported.

Every cell pools the session records of all its seeds into one `summarize()`; per-seed attainment is
kept in `slo_attainment_by_seed`.
"""
from tandem.bench.experiment.candidates import check_fits, deployment_candidates
from tandem.bench.experiment.presets import PRESETS, preset
from tandem.bench.experiment.report import format_cells, relative_improvement, summary_text
from tandem.bench.experiment.spec import (DEFAULT_GPUS, ExperimentError, ExperimentSpec, canonical_gpu,
                                          canonical_model, policy_is_colocated, reference_rate, validate_spec,
                                          workload_gpus, workload_slo)
from tandem.bench.experiment.sweep import run_experiment
from tandem.bench.experiment.tasks import Task, TaskResult, run_task

__all__ = [
    "DEFAULT_GPUS", "PRESETS", "ExperimentError", "ExperimentSpec", "Task", "TaskResult", "canonical_gpu",
    "canonical_model", "check_fits", "deployment_candidates", "format_cells", "policy_is_colocated", "preset",
    "reference_rate", "relative_improvement", "run_experiment", "run_task", "summary_text", "validate_spec",
    "workload_gpus", "workload_slo",
]
