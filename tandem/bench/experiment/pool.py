"""Runs a sweep's simulations in-process or in a process pool, with an optional progress bar."""
from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Executor

from tandem.bench.experiment.tasks import Task, TaskResult, run_task
from tandem.bench.parallel import ParallelMap


class Runner(ParallelMap):
    """Runs experiment tasks (tandem.bench.parallel.ParallelMap with the sweep's labels), on `executor` if given."""

    def __init__(self, jobs: int, progress: bool, total: int, executor: Executor | None = None):
        super().__init__(jobs, progress, total, width=44, executor=executor)
        self.jobs = jobs

    def run(self, tasks: Sequence[Task], label: str) -> list[TaskResult]:
        """Run `tasks`; results in the order given."""
        return self.map(run_task, tasks, lambda t: f"{label} {t.workload}/{t.policy} @{t.rate:g}")
