"""The planner's objective Z = max(T, I) of a run's records, and the per-session facts it needs (package docstring)."""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from tandem.workload.session import Session

INF = float("inf")


@dataclass(slots=True)
class Info:
    """Per-session facts the objective needs: servable rounds, which have ITL samples, the SLO."""

    by_id: dict[str, tuple[int, tuple[bool, ...], float, float]]
    n_ttft: int
    n_itl: int


def _info(sessions: Sequence[Session], max_context: int) -> Info:
    by_id, n_t, n_i = {}, 0, 0
    for s in sessions:
        ctx, servable = 0, 0
        for r in s.rounds:
            ctx += r.input_tokens + r.output_tokens
            if ctx > max_context:
                break
            servable += 1
        has_itl = tuple(r.output_tokens >= 2 for r in s.rounds[:servable])
        if s.slo is None:
            raise ValueError(f"session {s.session_id!r} has no SLO; the planner needs one per session")
        by_id[s.session_id] = (servable, has_itl, s.slo.ttft_s, s.slo.itl_s)
        n_t += servable
        n_i += sum(has_itl)
    return Info(by_id, n_t, n_i)


def p95(values: list[float]) -> float:
    """numpy's default (linear) 95th percentile, infinite values allowed; 0 for no values."""
    if not values:
        return 0.0
    s = sorted(values)
    pos = 0.95 * (len(s) - 1)
    i = math.floor(pos)
    f = pos - i
    if i + 1 >= len(s) or f == 0:
        return s[i]
    if math.isinf(s[i + 1]):
        return INF
    return s[i] + f * (s[i + 1] - s[i])


def needed_above(n: int) -> int:
    """Samples above v that prove the linear 95th percentile of n samples exceeds v."""
    return n - math.floor(0.95 * (n - 1)) if n > 0 else 1


def objective(records, info: Info) -> tuple[float, float, float, float]:
    """(ttft_norm, itl_norm, ttft_p95_s, itl_p95_s) of finished session records (package docstring)."""
    tn, tr, itn, itr = [], [], [], []
    for rec in records:
        servable, has_itl, slo_t, slo_i = info.by_id[rec.session_id]
        rounds = rec.rounds
        for k in range(servable):
            r = rounds[k] if k < len(rounds) else None
            ttft = None if r is None else r.ttft_s
            if ttft is None:
                tn.append(INF)
                tr.append(INF)
            else:
                tn.append(ttft / slo_t)
                tr.append(ttft)
            if has_itl[k]:
                if r is not None and r.finish_s is not None and r.itl_count > 0:
                    itl = r.itl_sum_s / r.itl_count
                    itn.append(itl / slo_i)
                    itr.append(itl)
                else:
                    itn.append(INF)
                    itr.append(INF)
    return p95(tn), p95(itn), p95(tr), p95(itr)


_INFOS: dict[tuple[str, int], Info] = {}


def info_for(sessions: Sequence[Session], workload_key: str, max_context: int) -> Info:
    key = (workload_key, max_context)
    info = _INFOS.get(key)
    if info is None:
        if len(_INFOS) > 16:
            _INFOS.clear()
        info = _INFOS[key] = _info(sessions, max_context)
    return info
