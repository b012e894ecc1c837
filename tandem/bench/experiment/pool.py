"""Runs a sweep's simulations in-process or in a process pool, with an optional progress bar."""
from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed

from tandem.bench.experiment.tasks import Task, TaskResult, run_task


def _ignore_sigint() -> None:
    """Pool workers leave Ctrl-C to the parent, which stops them (no traceback from each worker)."""
    import signal
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class _Runner:
    """Runs tasks in-process or in a process pool, advancing an optional rich progress bar."""

    def __init__(self, jobs: int, progress: bool, total: int):
        self.jobs = jobs
        self.pool = ProcessPoolExecutor(max_workers=jobs, initializer=_ignore_sigint) if jobs > 1 else None
        self.bar = None
        self.bar_task = None
        if progress:
            from rich.console import Console
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                       TimeElapsedColumn, TimeRemainingColumn)
            self.bar = Progress(TextColumn("{task.description:<44}"), BarColumn(), MofNCompleteColumn(),
                                TimeElapsedColumn(), TimeRemainingColumn(), console=Console(stderr=True),
                                transient=False)
            self.bar.start()
            self.bar_task = self.bar.add_task("simulating", total=total)

    def run(self, tasks: Sequence[Task], label: str) -> list[TaskResult]:
        """Run `tasks`; results in the order given."""
        out: list[TaskResult | None] = [None] * len(tasks)
        if self.pool is None:
            for i, t in enumerate(tasks):
                self._describe(label, t)
                out[i] = run_task(t)
                self._advance()
        else:
            futures = {self.pool.submit(run_task, t): i for i, t in enumerate(tasks)}
            for fut in as_completed(futures):
                i = futures[fut]
                out[i] = fut.result()
                self._describe(label, tasks[i])
                self._advance()
        return out  # type: ignore[return-value]

    def _describe(self, label: str, t: Task) -> None:
        if self.bar is not None:
            self.bar.update(self.bar_task, description=f"{label} {t.workload}/{t.policy} @{t.rate:g}")

    def _advance(self) -> None:
        if self.bar is not None:
            self.bar.advance(self.bar_task)

    def close(self, cancel: bool = False) -> None:
        """Stop the bar and the pool (cancelling queued work when `cancel`)."""
        if self.bar is not None:
            self.bar.stop()
        if self.pool is not None:
            if cancel:  # Ctrl-C or an error: stop the workers now rather than after their current run
                for proc in list(getattr(self.pool, "_processes", {}).values()):
                    proc.terminate()
            self.pool.shutdown(wait=not cancel, cancel_futures=cancel)
