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
from tandem.bench.experiment.candidates import TP_DEGREES, check_fits, deployment_candidates, fitting_tps
from tandem.bench.experiment.presets import PRESETS, preset
from tandem.bench.experiment.report import (ABLATION_POLICIES, BASELINES, PAPER_IMPROVEMENT,
                                            PAPER_MEAN_IMPROVEMENT, format_cells, relative_improvement,
                                            summary_text)
from tandem.bench.experiment.search import plan_deploy, search_rates
from tandem.bench.experiment.spec import (COLOCATED_POLICIES, DEFAULT_GPUS, ExperimentError, ExperimentSpec,
                                          canonical_gpu, canonical_model, policy_is_colocated, reference_rate,
                                          validate_spec, workload_gpus, workload_slo)
from tandem.bench.experiment.sweep import run_experiment
from tandem.bench.experiment.tasks import Task, TaskResult, cell_summary, run_task

__all__ = [
    "ABLATION_POLICIES", "BASELINES", "COLOCATED_POLICIES", "DEFAULT_GPUS", "PAPER_IMPROVEMENT",
    "PAPER_MEAN_IMPROVEMENT", "PRESETS", "TP_DEGREES", "ExperimentError", "ExperimentSpec", "Task", "TaskResult",
    "canonical_gpu", "canonical_model", "cell_summary", "check_fits", "deployment_candidates", "fitting_tps",
    "format_cells", "plan_deploy", "policy_is_colocated", "preset", "reference_rate", "relative_improvement",
    "run_experiment", "run_task", "search_rates", "summary_text", "validate_spec", "workload_gpus", "workload_slo",
]
