"""Ray tasks behind the `concurrent.futures.Executor` interface: the Ray backend of every parallel sweep
(`tandem experiment --ray`, `tandem plan --ray`, through tandem.bench.parallel.ParallelMap and the planner's
Evaluator), so a sweep runs its simulations on the CPUs of a Ray cluster with no code of its own for Ray.

Each submitted call is one Ray task of one CPU; its result (or exception) comes back as a concurrent future. The
tasks are the same pure functions of their inputs a local pool runs, so the results are the same (docs/ray.md).
"""
from __future__ import annotations

import uuid
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any


class RayExecutor(Executor):
    """Submits calls as Ray tasks (one CPU each) on the Ray cluster joined by `connect`."""

    def __init__(self, ray: Any) -> None:
        self._ray = ray
        self._remote: dict[Callable, Any] = {}
        self._pending: dict[Future, Any] = {}

    @classmethod
    def connect(cls, address: str | None) -> RayExecutor:
        """Join the Ray cluster at `address` ('auto', HOST:PORT; None: $RAY_ADDRESS or a private one here)."""
        from tandem.runtime.ray_launcher import connect
        return cls(connect(address, namespace=f"tandem-sweep-{uuid.uuid4().hex[:8]}"))

    @property
    def cpus(self) -> int:
        """Logical CPUs of the cluster: how many tasks run at once."""
        return max(1, int(self._ray.cluster_resources().get("CPU", 1)))

    def submit(self, fn: Callable, /, *args: Any, **kwargs: Any) -> Future:
        """fn(*args, **kwargs) as a Ray task; its future."""
        remote = self._remote.get(fn)
        if remote is None:
            remote = self._remote[fn] = self._ray.remote(num_cpus=1)(fn)
        ref = remote.remote(*args, **kwargs)
        fut = ref.future()
        self._pending[fut] = ref
        fut.add_done_callback(lambda f: self._pending.pop(f, None))
        return fut

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Cancel the tasks not finished (with `cancel_futures`); the connection stays for further sweeps."""
        if cancel_futures:
            for ref in list(self._pending.values()):
                try:
                    self._ray.cancel(ref, force=True)
                except Exception:  # noqa: BLE001 - finished meanwhile, or the cluster is gone
                    pass
            self._pending.clear()

    def close(self) -> None:
        """Cancel what is left and disconnect from Ray."""
        self.shutdown(cancel_futures=True)
        if self._ray.is_initialized():
            self._ray.shutdown()


__all__ = ["RayExecutor"]
