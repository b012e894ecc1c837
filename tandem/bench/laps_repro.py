"""LAPS Fig. 6 and Fig. 7 in the simulator: the grid of cells (closed-loop chat-multiturn clients against prefill/decode
deployments on H200), one simulation per cell, its metrics, the seeds' means and the headline comparison."""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from functools import lru_cache, partial

import numpy as np

from tandem.bench.parallel import ParallelMap
from tandem.perf.costs import DEFAULT_COST_MODEL
from tandem.sim.cluster import SimConfig, SimResult, simulate
from tandem.workload.generators import default_slo, generate
from tandem.workload.session import Round, Session

WORKLOAD = "chat-multiturn"
GPU = "h200"
SHORT_TOKENS = 256          # LAPS's class boundary (its code's default): the short/long split of the report
PAPER = {"violations_vs_pd": -0.28, "violations_vs_router": -0.12, "prefill_latency": -0.30, "throughput": 0.35}
LAPS_POLICY, PD_POLICY, ROUTER_POLICY, VLLM_PD_POLICY = "laps", "sglang-pd", "sglang-pd-router", "vllm-pd"


class Client(StrEnum):
    """What a closed-loop client waits for before sending its next turn."""

    CHAT = "chat"           # the whole answer (ShareGPT output lengths)
    PREFILL = "prefill"     # the first token only (one output token per turn): the prefill stage


@dataclass(frozen=True, slots=True)
class Grid:
    """What the reproduction sweeps, and how many sessions each cell runs."""

    models: tuple[str, ...] = ("qwen2.5-7b", "qwen2.5-14b", "qwen2.5-32b")
    instances: tuple[int, ...] = (1, 8)
    concurrency: tuple[int, ...] = (1, 4, 16, 32, 64)
    policies: tuple[str, ...] = ("sglang-pd", "sglang-pd-router", "vllm-pd", "laps", "laps-no-graph", "laps-no-split",
                                 "ampd+laps")
    clients: tuple[Client, ...] = (Client.CHAT, Client.PREFILL)
    seeds: tuple[int, ...] = (0, 1, 2)
    decode_workers: int = 8
    cost_model: str = DEFAULT_COST_MODEL
    sessions_per_client: tuple[tuple[Client, int], ...] = ((Client.CHAT, 16), (Client.PREFILL, 40))
    min_sessions: tuple[tuple[Client, int], ...] = ((Client.CHAT, 64), (Client.PREFILL, 128))

    def sessions(self, client: Client, concurrency: int) -> int:
        """Conversations one cell runs: enough per client for a steady state (the pool controller's 5 s cool-down
        needs tens of simulated seconds under prefill-bound load)."""
        return max(dict(self.min_sessions)[client], dict(self.sessions_per_client)[client] * concurrency)

    def cells(self) -> list[Cell]:
        """Every (model, instances, client, concurrency, policy, seed), the most expensive first."""
        out = [Cell(m, n, c, k, p, s) for m in self.models for n in self.instances for c in self.clients
               for k in self.concurrency for p in self.policies for s in self.seeds]
        return sorted(out, key=lambda c: -self.sessions(c.client, c.concurrency))


QUICK = Grid(models=("qwen2.5-32b",), concurrency=(4, 64), seeds=(0,), sessions_per_client=((Client.CHAT, 6), (Client.PREFILL, 16)),
             min_sessions=((Client.CHAT, 24), (Client.PREFILL, 48)))


@dataclass(frozen=True, slots=True)
class Cell:
    """One simulation of the grid."""

    model: str
    instances: int
    client: Client
    concurrency: int
    policy: str
    seed: int

    def deploy(self, decode_workers: int) -> str:
        return f"P:tp1x{self.instances},D:tp1x{decode_workers}"

    @property
    def group(self) -> tuple[str, int, str, int, str]:
        """The cell without its seed (seeds are averaged)."""
        return (self.model, self.instances, str(self.client), self.concurrency, self.policy)


# --------------------------------------------------------------------------- one cell


@lru_cache(maxsize=32)
def _base_sessions(n: int, seed: int) -> tuple[Session, ...]:
    return tuple(generate(WORKLOAD, n, 1.0, seed, slo=default_slo("", WORKLOAD)))


def client_sessions(client: Client, n: int, seed: int) -> list[Session]:
    """The workload's conversations as closed-loop clients send them: no think time; `prefill` clients ask for one
    output token per turn. Arrival times are the loop's (SimConfig.concurrency)."""
    out = []
    for s in _base_sessions(n, seed):
        rounds = [Round(r.input_tokens, 1 if client is Client.PREFILL else r.output_tokens, 0.0, r.hash_ids)
                  for r in s.rounds]
        out.append(dataclasses.replace(s, rounds=rounds))
    return out


def _mean(xs: Sequence[float]) -> float | None:
    return float(np.mean(xs)) if len(xs) else None


def _p90(xs: Sequence[float]) -> float | None:
    return float(np.percentile(xs, 90)) if len(xs) else None


def cell_metrics(res: SimResult, slo_s: float) -> dict:
    """The cell's metrics from its per-round records: rounds/s while every client was busy (until the last
    conversation started), TTFT mean and P90 (all, initial, incremental, short, long), SLO violations over all rounds
    (over the SLO or no token), ITL, preemptions, prefill busy share and the LAPS counters."""
    recs = res.records
    busy_until = max((r.arrival_s for r in recs), default=0.0)   # the last conversation started: all clients busy
    window = busy_until if busy_until > 0 else res.sim_time_s
    rounds = [rr for r in recs for rr in r.rounds]
    total = sum(r.num_rounds for r in recs)
    ttft = [rr.ttft_s for rr in rounds if rr.ttft_s is not None]
    init = [rr.ttft_s for rr in rounds if rr.ttft_s is not None and rr.index == 0]
    incr = [rr.ttft_s for rr in rounds if rr.ttft_s is not None and rr.index > 0]
    short = [rr.ttft_s for rr in rounds if rr.ttft_s is not None and rr.input_tokens < SHORT_TOKENS]
    long = [rr.ttft_s for rr in rounds if rr.ttft_s is not None and rr.input_tokens >= SHORT_TOKENS]
    ok = sum(1 for rr in rounds if rr.ttft_s is not None and rr.ttft_s <= slo_s)
    done = sum(1 for rr in rounds if rr.finish_s is not None and rr.finish_s <= window)
    itl_n = sum(rr.itl_count for rr in rounds)
    prefill = [w for w in res.workers if str(w["role"]) == "prefill"]
    laps = [w["laps"] for w in prefill if "laps" in w]
    short_steps = sum(x["short_steps"] for x in laps)
    return {
        "sessions": len(recs), "sessions_failed": sum(1 for r in recs if r.failed), "rounds": total,
        "window_s": window, "sim_time_s": res.sim_time_s, "wall_s": res.wall_s,
        "rounds_per_s": done / window if window > 0 else None,
        "ttft_mean_s": _mean(ttft), "ttft_p90_s": _p90(ttft),
        "ttft_initial_mean_s": _mean(init), "ttft_initial_p90_s": _p90(init),
        "ttft_incremental_mean_s": _mean(incr), "ttft_incremental_p90_s": _p90(incr),
        "ttft_short_mean_s": _mean(short), "ttft_long_mean_s": _mean(long),
        "slo_violation_rate": 1.0 - ok / total if total else None,
        "itl_mean_s": sum(rr.itl_sum_s for rr in rounds) / itl_n if itl_n else None,
        "preemptions": sum(rr.preemptions for rr in rounds),
        "prefill_busy": _mean([w["busy_s"] / res.sim_time_s for w in prefill]) if res.sim_time_s > 0 else None,
        "pool_moves": len(res.pool_moves),
        "graph_step_share": sum(x["graph_steps"] for x in laps) / short_steps if short_steps else None,
        "padded_tokens": sum(x["padded_tokens"] for x in laps) if laps else None,
    }


def run_cell(cell: Cell, grid: Grid) -> dict:
    """Simulate one cell; its metrics with the cell's coordinates."""
    n = grid.sessions(cell.client, cell.concurrency)
    sessions = client_sessions(cell.client, n, cell.seed)
    slo = sessions[0].slo.ttft_s if sessions and sessions[0].slo is not None else 0.4
    cfg = SimConfig(model=cell.model, gpu=GPU, gpus=cell.instances + grid.decode_workers,
                    deploy=cell.deploy(grid.decode_workers), policy=cell.policy, seed=cell.seed,
                    concurrency=cell.concurrency, cost_model=grid.cost_model)
    res = simulate(sessions, cfg)
    row = {"model": cell.model, "instances": cell.instances, "client": str(cell.client),
           "concurrency": cell.concurrency, "policy": cell.policy, "seed": cell.seed, "deploy": res.deployment,
           "slo_ttft_s": slo}
    row.update(cell_metrics(res, slo))
    return row


# --------------------------------------------------------------------------- the grid


def run_grid(grid: Grid, jobs: int, progress: bool) -> list[dict]:
    """Every cell of the grid (in a process pool when jobs > 1), with a rich progress bar when `progress`."""
    cells = grid.cells()
    with ParallelMap(jobs, progress, len(cells), width=52) as runner:
        rows = runner.map(partial(run_cell, grid=grid), cells,
                          lambda c: f"{c.model} P{c.instances} {c.client} c={c.concurrency} {c.policy}")
    return sorted(rows, key=lambda r: (r["model"], r["instances"], r["client"], r["concurrency"],
                                       grid.policies.index(r["policy"]), r["seed"]))


AVERAGED = ("rounds_per_s", "ttft_mean_s", "ttft_p90_s", "ttft_initial_mean_s", "ttft_initial_p90_s",
            "ttft_incremental_mean_s", "ttft_incremental_p90_s", "ttft_short_mean_s", "ttft_long_mean_s",
            "slo_violation_rate", "itl_mean_s", "prefill_busy", "graph_step_share", "pool_moves")
SUMMED = ("sessions", "sessions_failed", "rounds", "preemptions", "wall_s")


def aggregate(rows: list[dict]) -> list[dict]:
    """One row per cell without its seed: the seeds' mean of each metric (sums of the counts)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["instances"], r["client"], r["concurrency"], r["policy"]), []).append(r)
    out = []
    for key, rs in groups.items():
        a = dict(zip(("model", "instances", "client", "concurrency", "policy"), key))
        a["seeds"] = [r["seed"] for r in rs]
        a["deploy"] = rs[0]["deploy"]
        a["slo_ttft_s"] = rs[0]["slo_ttft_s"]
        for k in AVERAGED:
            vals = [r[k] for r in rs if r.get(k) is not None]
            a[k] = float(np.mean(vals)) if vals else None
        for k in SUMMED:
            a[k] = sum(r[k] for r in rs)
        out.append(a)
    return out


def find_cell(agg: list[dict], **kw) -> dict | None:
    """The first aggregated cell whose fields equal `kw`, or None."""
    return next((a for a in agg if all(a[k] == v for k, v in kw.items())), None)


def _rel(new: float | None, old: float | None) -> float | None:
    if new is None or old is None or old == 0:
        return None
    return new / old - 1.0


def headline(agg: list[dict], grid: Grid) -> list[dict]:
    """The graph check: at the largest model, instance count and concurrency of the grid (Qwen2.5-32B, 8 prefill
    instances, 64 clients by default), LAPS against SGLang-PD, its router and vLLM-PD, per client kind."""
    model = "qwen2.5-32b" if "qwen2.5-32b" in grid.models else grid.models[-1]
    inst, conc = max(grid.instances), max(grid.concurrency)
    out = []
    for client in grid.clients:
        at = dict(model=model, instances=inst, client=str(client), concurrency=conc)
        laps = find_cell(agg, policy=LAPS_POLICY, **at)
        if laps is None:
            continue
        h = {**at, "laps": _pick(laps)}
        for name, pol in (("vs_pd", PD_POLICY), ("vs_router", ROUTER_POLICY), ("vs_vllm_pd", VLLM_PD_POLICY)):
            base = find_cell(agg, policy=pol, **at)
            if base is None:
                continue
            h[pol] = _pick(base)
            h[name] = {"slo_violation_points": laps["slo_violation_rate"] - base["slo_violation_rate"],
                       "slo_violation_rel": _rel(laps["slo_violation_rate"], base["slo_violation_rate"]),
                       "ttft_mean_rel": _rel(laps["ttft_mean_s"], base["ttft_mean_s"]),
                       "ttft_p90_rel": _rel(laps["ttft_p90_s"], base["ttft_p90_s"]),
                       "rounds_per_s_rel": _rel(laps["rounds_per_s"], base["rounds_per_s"])}
        out.append(h)
    return out


def _pick(a: dict) -> dict:
    return {k: a[k] for k in ("slo_violation_rate", "ttft_mean_s", "ttft_p90_s", "rounds_per_s",
                              "ttft_short_mean_s", "ttft_long_mean_s", "prefill_busy", "pool_moves")}
