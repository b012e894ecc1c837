"""The planner's search space: feasible tensor-parallel degrees and prefill/decode deployments.

A *side* is `count` replicas of one role at one tensor-parallel degree; a *pair* is a prefill side
plus a decode side, i.e. a deployment `P:tp{n}x{x},D:tp{m}x{y}` (AMPD Table 2 writes it
`P:<TP=n, DP=x>, D:<TP=m, DP=y>`). A pair is *maximal* for a budget of N GPUs when neither
another prefill replica nor another decode replica fits in the GPUs it leaves unused.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from tandem.perf.errors import DoesNotFitError, ParallelismError
from tandem.perf.hardware import GIB, get_gpu
from tandem.perf.models import get_model
from tandem.perf.roofline import ACTIVATION_RESERVE_GIB, MEM_UTIL, kv_capacity_tokens, supported_tps

DEGREES: tuple[int, ...] = (1, 2, 4, 8)
"""AMPD's candidate model-parallel degrees T."""

MIN_KV_FLOOR_TOKENS = 2048
"""Smallest KV pool a worker must have even for tiny workloads: one chunked-prefill step."""


class PlanError(ValueError):
    """The planning problem has no answer (model does not fit, no SLO met, bad inputs); the message says why."""


@dataclass(frozen=True, slots=True, order=True)
class Pair:
    """A disaggregated deployment: `x` prefill replicas of tp `n`, `y` decode replicas of tp `m`."""

    n: int
    x: int
    m: int
    y: int

    @property
    def gpus(self) -> int:
        return self.n * self.x + self.m * self.y

    @property
    def deploy(self) -> str:
        """The form `tandem simulate --deploy` takes."""
        return f"P:tp{self.n}x{self.x},D:tp{self.m}x{self.y}"

    @property
    def table2(self) -> str:
        """AMPD Table 2's notation."""
        return f"P:<TP={self.n}, DP={self.x}>, D:<TP={self.m}, DP={self.y}>"

    def maximal(self, budget: int) -> bool:
        """No further prefill or decode replica fits in the GPUs this pair leaves unused."""
        left = budget - self.gpus
        return 0 <= left < min(self.n, self.m)

    def scaled(self, factor: float, budget: int) -> "Pair":
        """This pair's prefill count scaled by `factor`, the decode side taking the rest of `budget`,
        then prefill replicas added while one fits (used to map a slice plan up to the full cluster)."""
        x = max(1, round(self.x * factor))
        while x > 1 and self.n * x + self.m > budget:
            x -= 1
        y = max(1, (budget - self.n * x) // self.m)
        while budget - self.n * x - self.m * y >= self.n:
            x += 1
        return Pair(self.n, x, self.m, y)


def parse_pair(deploy: str) -> Pair:
    """The Pair of a deployment string with exactly one prefill and one decode group."""
    from tandem.core.deploy import parse_deploy

    dep = parse_deploy(deploy)
    pre = [g for g in dep.groups if g.role == "prefill"]
    dec = [g for g in dep.groups if g.role == "decode"]
    if len(pre) != 1 or len(dec) != 1:
        raise PlanError(f"the planner handles one prefill and one decode group, got {deploy!r}")
    return Pair(pre[0].tp, pre[0].count, dec[0].tp, dec[0].count)


def min_kv_tokens(sessions, max_context: int) -> int:
    """KV pool one worker needs so that every session the model can serve fits on it: the largest
    context a session reaches within the model's maximum context (floor MIN_KV_FLOOR_TOKENS)."""
    need = MIN_KV_FLOOR_TOKENS
    for s in sessions:
        ctx = 0
        for r in s.rounds:
            nxt = ctx + r.input_tokens + r.output_tokens
            if nxt > max_context:
                break
            ctx = nxt
        need = max(need, ctx)
    return need


def feasible_degrees(model: str, gpu: str, gpus: int, min_kv: int,
                     degrees: tuple[int, ...] = DEGREES) -> tuple[list[int], dict[int, str]]:
    """Degrees n in `degrees` at which one worker holds the weights plus a KV pool of `min_kv` tokens
    and a prefill and a decode worker fit in `gpus` together; and why each other degree is out."""
    spec, g = get_model(model), get_gpu(gpu)
    shardable = set(supported_tps(spec, g))
    ok, why = [], {}
    for n in degrees:
        if n not in shardable:
            why[n] = f"tp{n} is not a valid sharding of {spec.name} on {g.gpus_per_node}-GPU {g.name} nodes"
            continue
        try:
            cap = kv_capacity_tokens(spec, g, n)
        except (DoesNotFitError, ParallelismError) as e:
            why[n] = str(e)
            continue
        if cap < min_kv:
            why[n] = (f"tp{n} leaves a KV pool of {cap} tokens per worker, below the {min_kv} tokens the "
                      f"longest session needs")
            continue
        ok.append(n)
    return ok, why


def explain_no_fit(model: str, gpu: str, gpus: int, min_kv: int, degrees: tuple[int, ...] = DEGREES) -> str:
    """One line saying which constraint keeps `model` off `gpus` x `gpu`, and by how much."""
    spec, g = get_model(model), get_gpu(gpu)
    ok, why = feasible_degrees(model, gpu, gpus, min_kv, degrees)
    usable_gb = (g.hbm_bytes * MEM_UTIL - ACTIVATION_RESERVE_GIB * GIB) / 1e9
    weights_gb = spec.weight_bytes / 1e9
    if not ok:
        largest = max((n for n in degrees if n <= g.gpus_per_node), default=1)
        if weights_gb / largest >= usable_gb:
            return (f"{spec.name} does not fit {g.name}: its weights ({weights_gb:.1f} GB) need "
                    f"{weights_gb / usable_gb:.1f} GPUs of {usable_gb:.1f} GB usable each, more than the largest "
                    f"tensor-parallel degree a worker may span (tp{largest}, inside one {g.gpus_per_node}-GPU node)")
        return (f"no tensor-parallel degree of {spec.name} on {g.name} holds its weights ({weights_gb:.1f} GB) plus a "
                f"KV pool of {min_kv} tokens per worker: " + "; ".join(why[n] for n in sorted(why)))
    n0 = min(ok)
    need = 2 * n0
    return (f"{spec.name} does not fit {gpus} x {g.name}: a disaggregated deployment needs a prefill and a decode "
            f"worker of at least tp{n0} each (weights {weights_gb:.1f} GB, {usable_gb:.1f} GB usable per GPU), "
            f"i.e. {need} GPUs; {gpus} given, {need - gpus} short")


def pairs(degrees: list[int], budget: int, maximal_only: bool) -> list[Pair]:
    """Every pair of the degrees within `budget` GPUs (only the maximal ones when asked)."""
    out = []
    for n in degrees:
        for x in range(1, budget // n + 1):
            for m in degrees:
                for y in range(1, (budget - n * x) // m + 1):
                    p = Pair(n, x, m, y)
                    if not maximal_only or p.maximal(budget):
                        out.append(p)
    return out


def slice_gpus_for(budget: int, slice_gpus: int) -> int:
    """GPUs of the slice that stands for a cluster of `budget` GPUs (a divisor-friendly power of two)."""
    if budget <= slice_gpus:
        return budget
    return 1 << int(math.log2(slice_gpus))
