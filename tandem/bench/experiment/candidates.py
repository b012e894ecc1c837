"""Which deployments of a model on a cluster fit, and the candidates the deployment search tries."""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from tandem.core.deploy import parse_deploy

TP_DEGREES: tuple[int, ...] = (1, 2, 4, 8)


def fitting_tps(model: str, gpu: str, gpus: int, tps: Iterable[int] = TP_DEGREES) -> list[int]:
    """Tensor-parallel degrees (<= gpus) at which one worker holds the model with room for KV."""
    from tandem.perf.errors import DoesNotFitError, ParallelismError
    from tandem.perf.roofline import kv_capacity_tokens
    out = []
    for tp in tps:
        if tp > gpus:
            continue
        try:
            if kv_capacity_tokens(model, gpu, tp) > 0:
                out.append(tp)
        except (DoesNotFitError, ParallelismError):
            continue
    return out


def check_fits(model: str, gpu: str, deploy: str) -> None:
    """Raise DoesNotFitError (or ParallelismError) unless every worker of `deploy` holds the model."""
    from tandem.perf.roofline import kv_capacity_tokens
    for tp in sorted({g.tp for g in parse_deploy(deploy).groups}):
        kv_capacity_tokens(model, gpu, tp)


def _disaggregated(tps: Sequence[int], gpus: int, cap: int) -> list[str]:
    step = max(gpus // 8, 1)
    by_pair: dict[tuple[int, int], list[tuple[bool, int, int, str]]] = {}
    for ta in tps:
        for tb in tps:
            for na in range(1, gpus // ta + 1):
                rest = gpus - ta * na
                if rest <= 0 or rest % tb:
                    continue
                nb = rest // tb
                gp, gd = ta * na, tb * nb
                coarse = gp % step != 0  # off the grid of multiples of gpus/8: tried last
                by_pair.setdefault((ta, tb), []).append((coarse, abs(gp - gd), -gd, f"P:tp{ta}x{na},D:tp{tb}x{nb}"))
    pairs = sorted(by_pair, key=lambda p: (abs(math.log2(p[0]) - math.log2(p[1])), max(p), p))
    queues = [[d for *_, d in sorted(by_pair[p])] for p in pairs]
    out: list[str] = []
    depth = 0
    while len(out) < cap and any(depth < len(q) for q in queues):
        for q in queues:
            if depth < len(q) and len(out) < cap:
                out.append(q[depth])
        depth += 1
    return out


def deployment_candidates(model: str, gpu: str, gpus: int, colocated: bool, cap: int = 12) -> list[str]:
    """Deployments using exactly `gpus` GPUs whose every worker fits the model, at most `cap` of them.

    Co-located: C:tp x (gpus/tp) for each fitting tp in {1, 2, 4, 8} dividing `gpus`.
    Disaggregated: P:tp_a x n_a, D:tp_b x n_b with tp_a n_a + tp_b n_b = gpus. When there are more
    than `cap`, they are taken round-robin over the (tp_a, tp_b) pairs (equal degrees first, then
    by how far apart the degrees are, then smaller), each pair's splits from the most balanced
    (|P GPUs - D GPUs| smallest, more decode GPUs first), splits whose prefill GPUs are a multiple
    of gpus/8 before the others; so the kept set spans every parallelism pairing before it spans
    less balanced splits, and those in coarse steps (16/16, then 12/20, 20/12 on 32 GPUs).
    """
    tps = fitting_tps(model, gpu, gpus)
    if colocated:
        return [f"C:tp{tp}x{gpus // tp}" for tp in tps if gpus % tp == 0][:cap]
    return _disaggregated(tps, gpus, cap)
