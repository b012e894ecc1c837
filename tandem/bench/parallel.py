"""A function mapped over many items in-process, in a process pool or on any other executor (Ray tasks:
tandem.bench.ray_pool.RayExecutor), with an optional rich progress bar: what every sweep (experiment, LAPS and
Optimus reproductions) runs its simulations with."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Executor, ProcessPoolExecutor, as_completed
from typing import Any


def ignore_sigint() -> None:
    """Pool workers leave Ctrl-C to the parent, which stops them (no traceback from each worker)."""
    import signal
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class ParallelMap:
    """Maps picklable functions over items, `jobs` processes at a time (in-process when 1), or on `executor` when
    given (e.g. Ray tasks; `jobs` is then ignored); results in order."""

    def __init__(self, jobs: int, progress: bool, total: int, width: int = 44,
                 executor: Executor | None = None) -> None:
        self.pool = executor if executor is not None else (
            ProcessPoolExecutor(max_workers=jobs, initializer=ignore_sigint) if jobs > 1 else None)
        self.bar = None
        self.bar_task = None
        if progress:
            from rich.console import Console
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                       TimeRemainingColumn)
            self.bar = Progress(TextColumn(f"{{task.description:<{width}}}"), BarColumn(), MofNCompleteColumn(),
                                TimeElapsedColumn(), TimeRemainingColumn(), console=Console(stderr=True),
                                transient=False)
            self.bar.start()
            self.bar_task = self.bar.add_task("simulating", total=total)

    def map(self, fn: Callable[[Any], Any], items: Sequence[Any], describe: Callable[[Any], str] = str) -> list:
        """fn(item) for every item, in the items' order; the bar advances as each finishes."""
        out: list = [None] * len(items)
        if self.pool is None:
            for i, item in enumerate(items):
                self._advance(describe(item), 0)
                out[i] = fn(item)
                self._advance(describe(item), 1)
        else:
            futures = {self.pool.submit(fn, item): i for i, item in enumerate(items)}
            for fut in as_completed(futures):
                i = futures[fut]
                out[i] = fut.result()
                self._advance(describe(items[i]), 1)
        return out

    def _advance(self, description: str, n: int) -> None:
        if self.bar is not None:
            self.bar.update(self.bar_task, advance=n, description=description)

    def close(self, cancel: bool = False) -> None:
        """Stop the bar and the pool (cancelling queued work when `cancel`)."""
        if self.bar is not None:
            self.bar.stop()
        if self.pool is not None:
            if cancel:  # Ctrl-C or an error: stop the workers now rather than after their current run
                for proc in list((getattr(self.pool, "_processes", None) or {}).values()):
                    proc.terminate()
            self.pool.shutdown(wait=not cancel, cancel_futures=cancel)

    def __enter__(self) -> ParallelMap:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(cancel=exc_type is not None)


__all__ = ["ParallelMap", "ignore_sigint"]
