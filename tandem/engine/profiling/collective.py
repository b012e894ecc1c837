"""Measures the all-reduces of a tensor-parallel worker on this host for `tandem profile` (tandem.perf.collective).

N processes (forked from multiprocessing's fork server, one torch thread each, as a tp-N worker's CPU ranks) join a
gloo group on the loopback device the way the engine's ranks do (tandem.engine.parallel.channel) and time float32
all-reduces of several sizes on rank 0, each after a barrier, so a time is one all-reduce with the ranks in step.
The all-reduces one engine step makes are counted from the loaded model: its row-parallel linears and its
vocabulary-parallel embedding, each of which sums its output over the ranks once per forward.
"""
from __future__ import annotations

import multiprocessing
import random
import statistics
import time
from typing import Sequence

import torch

from tandem.engine.models.layers import RowParallelLinear, VocabParallelEmbedding
from tandem.perf.collective import AllReduceFit

WARMUP = 5
JOIN_TIMEOUT_S = 120.0


def all_reduces_per_step(model: torch.nn.Module) -> int:
    """All-reduces one forward of `model` makes at tp>1: one per row-parallel linear (attention out, MLP down) and
    one for the vocabulary-parallel embedding. The logits are gathered to the driver, not all-reduced."""
    return sum(isinstance(m, (RowParallelLinear, VocabParallelEmbedding)) for m in model.modules())


def _member(rank: int, size: int, ports: "multiprocessing.Queue", out: "multiprocessing.Queue",
            sizes: Sequence[int], repeats: int) -> None:
    """One process of the measuring group; rank 0 serves the store and reports [(bytes, median seconds)]."""
    import torch.distributed as dist

    from tandem.engine.parallel import channel
    torch.set_num_threads(1)
    if rank == 0:
        sock = channel.listen_loopback()
        for _ in range(size - 1):
            ports.put(sock.getsockname()[1])
        store = channel.driver_store(sock, size)
        sock.detach()
    else:
        store = channel.rank_store(ports.get(timeout=JOIN_TIMEOUT_S), size)
    channel.join_group(store, rank, size, torch.device("cpu"))
    xs = [torch.ones(max(1, n // 4), dtype=torch.float32) for n in sizes]
    times: list[list[float]] = [[] for _ in sizes]
    order = random.Random(0)                       # the same order on every rank
    for r in range(WARMUP + repeats):              # rounds over the sizes: a burst of load hits one run of each
        idx = list(range(len(sizes)))
        order.shuffle(idx)
        for i in idx:
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(xs[i])
            if r >= WARMUP:
                times[i].append(time.perf_counter() - t0)
    rows = [(x.numel() * 4, statistics.median(t)) for x, t in zip(xs, times)]
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        out.put(rows)


def measure_all_reduce(ranks: int, sizes: Sequence[int], repeats: int = 40) -> AllReduceFit:
    """Time gloo all-reduces of `sizes` bytes among `ranks` processes of this host and fit latency + per-byte;
    RuntimeError (one line) when the group cannot be formed."""
    ctx = multiprocessing.get_context("forkserver" if "forkserver" in multiprocessing.get_all_start_methods()
                                      else "spawn")
    ports, out = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_member, args=(r, ranks, ports, out, list(sizes), repeats), daemon=True,
                         name=f"tandem-profile-allreduce{r}") for r in range(ranks)]
    for p in procs:
        p.start()
    try:
        rows = out.get(timeout=JOIN_TIMEOUT_S + 30 * len(sizes))
    except Exception:  # noqa: BLE001 - queue.Empty: a member died or hung; said in one line
        raise RuntimeError(f"could not time all-reduces among {ranks} processes on this host") from None
    finally:
        for p in procs:
            p.join(10.0)
            if p.is_alive():
                p.kill()
                p.join(5.0)
    return AllReduceFit.from_samples(ranks, rows)


def step_sizes(bytes_per_token: int, max_tokens: int, quick: bool) -> list[int]:
    """All-reduce sizes of steps of 1 .. max_tokens query tokens (what the engine's steps sum)."""
    top = max(2, max_tokens)
    toks = sorted({t for t in ((1, 64) if quick else (1, 8, 64, 512)) if t < top} | {top})
    return [t * bytes_per_token for t in toks]


__all__ = ["all_reduces_per_step", "measure_all_reduce", "step_sizes"]
