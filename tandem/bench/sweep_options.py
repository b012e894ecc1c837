"""How a sweep command (experiment, plan) runs its simulations: here, in worker processes, or as Ray tasks; the
knobs are fields (tandem.knob) so the commands' flags are generated from them."""
from __future__ import annotations

from dataclasses import dataclass

from tandem.knob import KnobError, csv_list, knob, positive_float, positive_int, seed
from tandem.runtime.ray_address import ray_address


def gpus_per_workload(text: str) -> int | dict[str, int]:
    """`N` (every workload) or `workload=N,...`."""
    if "=" not in text:
        return positive_int(text)
    out: dict[str, int] = {}
    for part in text.split(","):
        name, sep, n = part.partition("=")
        if not sep or not name.strip():
            raise KnobError(f"expected N or workload=N,..., got {text!r}")
        out[name.strip()] = positive_int(n.strip())
    return out


@dataclass(slots=True)
class SweepOptions:
    """Where a sweep's simulations run."""

    ray: bool = knob(False, "run the simulations as Ray tasks on a Ray cluster, one CPU each (pip install "
                     "'tandem[ray]'; docs/ray.md); the results are the same as a local run's")
    ray_address: str | None = knob(None, "--ray: the Ray cluster to join (auto: the one `ray start` started here; "
                                   "default: $RAY_ADDRESS, else a private Ray on this machine)", parse=ray_address,
                                   metavar="auto|HOST:PORT")
    no_progress: bool = knob(False, "no progress bar")


@dataclass(slots=True)
class ExperimentOptions:
    """Which preset sweep `tandem experiment` runs, narrowed (None: the preset's)."""

    preset: str = knob("demo", "demo, paper or ablation")
    model: str | None = knob(None, "model (default: the preset's)")
    gpu: str | None = knob(None, "GPU (default: the preset's)")
    workloads: list[str] | None = knob(None, "workloads", parse=csv_list(str), metavar="A,B")
    policies: list[str] | None = knob(None, "policies", parse=csv_list(str), metavar="A,B")
    rates: list[float] | None = knob(None, "arrival rates", parse=csv_list(positive_float), metavar="R1,R2")
    sessions: int | None = knob(None, "sessions per cell and seed", parse=positive_int)
    seeds: list[int] | None = knob(None, "seeds", parse=csv_list(seed), metavar="0,1")
    jobs: int | None = knob(None, "worker processes (default: 1)", parse=positive_int)
    gpus: int | dict[str, int] | None = knob(None, "GPUs per workload: one count for all, or e.g. "
                                             "toolbench=16,gaia=32 (default: AMPD's)", parse=gpus_per_workload,
                                             metavar="N|W=N,...")
    deploy_per_rate: bool = knob(False, "give each (workload, policy, rate) its own best deployment of the search "
                                 "(default: one per workload and policy, best mean over the rates)")
    out: str | None = knob(None, "report folder (default: reports/<preset>)", metavar="DIR")
