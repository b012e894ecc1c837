"""Measure this engine's step times on this device and fit the `perf` layer's cost models (`tandem profile`).

The ModelRunner is driven directly with hand-made batches, one engine step each: prefill-only steps
over chunk lengths and histories, decode-only steps over batch sizes and contexts, and mixed steps
(decodes riding along a prefill chunk, several prefill chunks together) as continuous batching makes
them. A step's time is the building of its ModelInput plus `ModelRunner.execute` (forward, KV write,
greedy sampling of one row per sequence), the median of a few repeats. History is KV already in the
pool: a step's block table points at blocks whose contents do not matter for timing.

A separate random grid of realistic batches (heterogeneous decode contexts, mixed steps) is held
out: the StepTimeModel is fitted on the training grid only and its median / p90 relative error on
the held-out steps is reported. See docs/profiler.md.
"""
from __future__ import annotations

import dataclasses
import datetime
import math
import os
import platform
import random
import socket
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from tandem.engine.config import EngineConfig
from tandem.engine.model_runner import ModelInput, ModelRunner
from tandem.engine.sampling_params import SamplingParams
from tandem.perf.roofline import BatchShape
from tandem.perf.step_model import DEFAULT_KV_LINK, SEGMENTS, Profile, StepTimeModel

__all__ = ["Point", "ProfileOptions", "Profile", "profile", "train_grid", "heldout_grid", "measure_kv_link",
           "measure_kv_path", "measure_interference", "device_info"]

Progress = Callable[[str, int, int], None]      # (stage, done, total)


@dataclass(frozen=True)
class Point:
    """One step to measure: prefill chunks as (l_hist, l_new) and decodes as KV length before the step."""

    kind: str                                       # prefill | decode | mixed
    prefills: tuple[tuple[int, int], ...] = ()
    decodes: tuple[int, ...] = ()

    def shape(self) -> BatchShape:
        """The BatchShape the worker core would give this step (decode context = KV length after it)."""
        s = BatchShape()
        for c in self.decodes:
            s.add_decode(c + 1)
        for h, n in self.prefills:
            s.add_prefill(h, n)
        return s

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.prefills) + len(self.decodes)

    @property
    def kv_tokens(self) -> int:
        """KV entries the step's sequences hold after it (what their block tables must cover)."""
        return sum(h + n for h, n in self.prefills) + sum(c + 1 for c in self.decodes)

    def blocks(self, block_size: int) -> int:
        """KV blocks the step's block tables need (every sequence rounds up to whole blocks)."""
        return sum(-(-(h + n) // block_size) for h, n in self.prefills) + sum(-(-(c + 1) // block_size)
                                                                            for c in self.decodes)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "prefills": [list(p) for p in self.prefills], "decodes": list(self.decodes)}


@dataclass
class ProfileOptions:
    """What to measure and how (CLI flags of `tandem profile`)."""

    quick: bool = False                 # small grid, sequences up to 1024: a smoke test, not a calibration
    max_len: int | None = None          # cap on sequence length profiled (default: the engine's max_model_len)
    repeats: int | None = None          # timed runs per step (rounds), median taken (default 3)
    device: str = "auto"
    threads: int | None = None          # torch CPU threads (default: torch's own choice)
    max_num_batched_tokens: int = 2048  # the engine's chunk budget: the largest step measured
    max_num_seqs: int = 256             # the engine's largest decode batch
    block_size: int = 16
    dtype: str = "auto"
    kv_cache_memory_bytes: int | None = None
    num_kv_blocks: int | None = None
    attention_backend: str | None = None
    heldout: int | None = None          # held-out steps (default 40; quick: 16)
    segments: int = SEGMENTS
    seed: int = 0
    point_budget_s: float = 1.0         # stop repeating a step once this much time went into it (>= 2 runs)
    measure_link: bool = True           # measure the KV path between two engines (export, wire, import)
    measure_interference: bool = True   # measure the step slow-down while another engine process steps (CPU)

    @property
    def n_repeats(self) -> int:
        return self.repeats if self.repeats is not None else 3

    @property
    def n_heldout(self) -> int:
        return self.heldout if self.heldout is not None else (16 if self.quick else 40)


# ------------------------------------------------------------------------------------------- grids

def _fits(p: Point, capacity: int, block_size: int) -> bool:
    """Whether the step's sequences fit the KV pool of `capacity` tokens in blocks of `block_size`."""
    return p.blocks(block_size) * block_size <= capacity


def _geom(lo: int, hi: int, per_octave: float) -> list[int]:
    """Integers from lo to hi (both included), `per_octave` per doubling, log-spaced."""
    if hi < lo:
        return []
    k = max(1, int(round(math.log2(max(hi / lo, 1)) * per_octave)) + 1)
    return sorted({int(round(lo * (hi / lo) ** (i / max(k - 1, 1)))) for i in range(k)})


def train_grid(budget: int, max_len: int, max_seqs: int, capacity: int, quick: bool = False,
               block_size: int = 16) -> list[Point]:
    """The fitting grid: prefill-only (lengths x histories), decode-only (batch x context), mixed steps.

    budget: the engine's max_num_batched_tokens (no step has more query tokens); max_len: longest
    sequence; capacity: KV pool tokens (no step holds more).
    """
    budget = max(1, min(budget, max_len - 1 if max_len > 1 else 1))
    pts: list[Point] = []

    def add(p: Point) -> None:
        if p.tokens <= budget and _fits(p, capacity, block_size) and all(h + n <= max_len for h, n in p.prefills) \
                and all(c + 1 <= max_len for c in p.decodes) and len(p.decodes) + len(p.prefills) <= max(max_seqs, 1):
            pts.append(p)

    lens0 = _geom(1, budget, 1 if quick else 2)                    # history 0: dense in length
    lens = _geom(1, budget, 1) if not quick else _geom(1, budget, 0.5)
    hists = [h for h in ([max_len // 4, max_len // 2] if quick else [64, max_len // 8, max_len // 2, max_len - budget])
             if 0 < h < max_len]
    for n in lens0:
        add(Point("prefill", ((0, n),)))
    for h in sorted(set(hists)):
        for n in lens:
            add(Point("prefill", ((h, n),)))

    batches = _geom(1, max_seqs, 0.5 if quick else 1)
    ctxs = sorted({c for c in ([16, 256, max_len // 2] if quick else [16, 128, 512, max_len // 4, max_len // 2, max_len - 1])
                   if 1 <= c < max_len})
    for c in ctxs:
        for b in batches:
            add(Point("decode", decodes=(c,) * b))

    # Mixed steps: decodes riding along one prefill chunk (the chunk small, medium, or filling the budget;
    # with history only at a medium size), and several prefill chunks batched together.
    mix_b = [1, 8, 32] if quick else [1, 8, 64]
    mix_c = [max_len // 4] if quick else [128, max_len // 4]
    for b in mix_b:
        for c in mix_c:
            for n in ([16, budget // 2, budget - b] if quick else [16, 256, budget - b]):
                if 1 <= n <= budget - b:
                    add(Point("mixed", ((0, n),), (c,) * b))
            if not quick and 256 <= budget - b:
                add(Point("mixed", ((max_len // 4, 256),), (c,) * b))
    for k in ([2, 4] if quick else [2, 4, 8]):
        for n in ([16, budget // k] if quick else [16, 128, budget // k]):
            if n >= 1:
                add(Point("mixed", ((0, n),) * k, ()))
            if not quick and n <= 128:
                add(Point("mixed", ((max_len // 8, n),) * k, ()))
    return list(dict.fromkeys(pts))                                  # drop duplicates, keep order


def heldout_grid(count: int, budget: int, max_len: int, max_seqs: int, capacity: int,
                 rng: random.Random, block_size: int = 16) -> list[Point]:
    """Random realistic steps, none on the training grid: single prefills with random history, decode
    batches whose contexts spread over a factor of 4, decodes riding a chunk, several chunks together."""
    budget = max(1, min(budget, max_len - 1 if max_len > 1 else 1))

    def logu(lo: float, hi: float) -> int:
        return int(round(math.exp(rng.uniform(math.log(lo), math.log(max(hi, lo))))))

    def ctxs(b: int) -> tuple[int, ...]:
        c0 = logu(16, max_len / 2)
        return tuple(min(max_len - 1, max(1, logu(c0 / 2, c0 * 2))) for _ in range(b))

    def hist(n: int) -> int:
        return 0 if rng.random() < 0.3 or max_len - n < 2 else logu(1, max_len - n)

    out: list[Point] = []
    kinds = ["prefill", "decode", "mixed", "multi"]
    tries = 0
    while len(out) < count and tries < 100 * count:
        tries += 1
        kind = kinds[len(out) % len(kinds)]
        if kind == "prefill":
            n = logu(1, budget)
            p = Point("prefill", ((hist(n), n),))
        elif kind == "decode":
            p = Point("decode", decodes=ctxs(logu(1, max_seqs)))
        elif kind == "mixed":
            b = logu(1, min(max_seqs, max(1, budget // 2)))
            n = logu(1, max(1, budget - b))
            p = Point("mixed", ((hist(n), n),), ctxs(b))
        else:
            k = rng.randint(2, 6)
            chunks = []
            for _ in range(k):
                n = logu(1, max(1, budget // k))
                chunks.append((hist(n), n))
            p = Point("mixed", tuple(chunks), ctxs(rng.randint(0, 8)) if rng.random() < 0.5 else ())
        if p.tokens <= budget and _fits(p, capacity, block_size) and all(h + n <= max_len for h, n in p.prefills) \
                and len(p.prefills) + len(p.decodes) <= max(max_seqs, 1):
            out.append(p)
    return out


# ------------------------------------------------------------------------------------------- measuring


AGREE = 1.1             # runs within 10% of each other need no more runs
EXTRA_ROUNDS = 4        # more runs (up to repeats + 4) for cheap steps whose runs disagree
CHEAP_S = 0.25          # a step is cheap while all its runs so far took less than this together


class _Bench:
    """Builds a ModelInput for a Point (random tokens, scattered distinct blocks) and times its execution."""

    def __init__(self, runner: ModelRunner, rng: random.Random) -> None:
        self.runner = runner
        self.rng = rng
        vocab = runner.model_config.vocab_size
        self.tokens = [rng.randrange(vocab) for _ in range(1 << 16)]
        self.blocks = list(range(runner.num_blocks))
        rng.shuffle(self.blocks)
        self.params = SamplingParams(temperature=0.0)
        self.cuda = runner.device.type == "cuda"

    def _table(self, start: int, n_tokens: int) -> tuple[list[int], int]:
        nb = -(-n_tokens // self.runner.block_size)
        return self.blocks[start:start + nb], start + nb

    def batch(self, p: Point) -> ModelInput:
        """One step's input: each prefill chunk and each decode is its own sequence and samples a row."""
        b = ModelInput()
        off = self.rng.randrange(max(1, self.runner.num_blocks - p.blocks(self.runner.block_size) + 1))
        toks, nt = self.tokens, len(self.tokens)
        for h, n in p.prefills:
            table, off = self._table(off, h + n)
            s = (h * 7919) % (nt - n) if nt > n else 0
            b.add(toks[s:s + n], h, table)
            self._sample(b)
        for c in p.decodes:
            table, off = self._table(off, c + 1)
            b.add([toks[c % nt]], c, table)
            self._sample(b)
        return b

    def _sample(self, b: ModelInput) -> None:
        b.sample_rows.append(len(b.query_lens) - 1)
        b.params.append(self.params)
        b.generators.append(None)
        b.output_tokens.append([])
        b.prompt_tokens.append([])

    def run(self, p: Point) -> float:
        """Seconds of one step: building its input and executing it (synchronised on CUDA)."""
        t0 = time.perf_counter()
        batch = self.batch(p)
        self.runner.execute(batch)
        if self.cuda:
            torch.cuda.synchronize(self.runner.device)
        return time.perf_counter() - t0

    def measure(self, points: list[Point], repeats: int, budget_s: float,
                progress: Callable[[int, int], None] | None = None) -> list[list[float]]:
        """Timed runs of every step, in rounds over all of them (each round in a fresh random order), so
        that a burst of load on a shared machine hits one run of many steps rather than every run of a few.

        `repeats` rounds, except that after two rounds a step that already took budget_s is skipped when
        its runs agree within AGREE; then up to EXTRA_ROUNDS more rounds for cheap steps (under CHEAP_S
        so far) whose runs still disagree, since scheduling jitter weighs most on short steps."""
        runs: list[list[float]] = [[] for _ in points]
        spent = [0.0] * len(points)
        rounds = repeats + EXTRA_ROUNDS
        total = rounds * len(points)
        done = 0
        for r in range(rounds):
            order = list(range(len(points)))
            self.rng.shuffle(order)
            for i in order:
                done += 1
                rs = runs[i]
                agree = bool(rs) and max(rs) <= AGREE * min(rs)
                if r >= repeats:
                    if agree or spent[i] >= CHEAP_S:
                        continue
                elif r >= 2 and spent[i] >= budget_s and agree:
                    continue
                t = self.run(points[i])
                rs.append(t)
                spent[i] += t
                if progress and (done % 8 == 0 or done == total):
                    progress(done, total)
        if progress:
            progress(total, total)
        return runs


def measure_kv_link(nbytes: int = 32 << 20, pings: int = 200) -> dict:
    """Bandwidth and one-way latency of a local socket pair (what KV between two engine processes on one
    host crosses at best): one bulk send timed to the last byte received, and half a small round trip."""
    a, b = socket.socketpair()
    try:
        payload = bytes(nbytes)
        done = threading.Event()
        buf = bytearray(1 << 20)

        def drain() -> None:
            got = 0
            while got < nbytes:
                k = b.recv_into(buf)
                if not k:
                    break
                got += k
            done.set()

        th = threading.Thread(target=drain, daemon=True)
        t0 = time.perf_counter()
        th.start()
        a.sendall(payload)
        done.wait(30)
        bw_s = time.perf_counter() - t0
        th.join(1)
        rtts = []
        for _ in range(pings):
            t = time.perf_counter()
            a.sendall(b"x")
            b.recv(1)
            b.sendall(b"y")
            a.recv(1)
            rtts.append(time.perf_counter() - t)
    finally:
        a.close()
        b.close()
    return {"bandwidth_bytes_per_s": nbytes / max(bw_s, 1e-9), "latency_s": statistics.median(rtts) / 2,
            "source": "measured: local socket pair"}


def _linear_fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(intercept >= 0, slope >= 0) of a least-squares line (a negative intercept is dropped)."""
    import numpy as np
    x, y = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
    if len(set(xs)) < 2:
        return 0.0, float(max(y.mean() / max(x.mean(), 1e-12), 0.0))
    slope, icpt = np.polyfit(x, y, 1)
    if icpt < 0:
        slope, icpt = float((x @ y) / (x @ x)), 0.0
    return float(max(icpt, 0.0)), float(max(slope, 1e-15))


def measure_kv_path(runner: ModelRunner, rng: random.Random, repeats: int = 7, max_tokens: int = 2048) -> dict:
    """The KV path between two engines on this host, as the runtime takes it (docs/profiler.md):

    export: `export_kv` gathers a sequence's positions out of the paged cache into one payload (the source
    worker does this between its steps); wire: the payload's bytes over ZeroMQ PUSH/PULL on TCP loopback (the
    runtime's peer KV channel), from the send until the receiver holds the bytes; import: `KVPayload.from_buffer`
    and `import_kv` scatter it into the destination's blocks. Each side is fitted as a + bytes / bandwidth over
    payloads of 16 .. max_tokens tokens (median of `repeats`); the wire's intercept is its latency."""
    import zmq

    from tandem.engine.kv_transfer import KVPayload, export_kv, import_kv

    bs = runner.block_size
    cap = runner.num_blocks * bs
    sizes = [n for n in (16, 64, 256, 1024, 2048) if n <= min(max_tokens, cap // 2)] or [min(16, cap // 2)]
    blocks = list(range(runner.num_blocks))
    ctx = zmq.Context.instance()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = ctx.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{port}")
    got: list = []
    ready = threading.Event()

    def receive() -> None:
        while True:
            frames = pull.recv_multipart(copy=True)
            got.append((time.perf_counter(), frames))
            ready.set()
            if frames[0] == b"stop":
                return

    th = threading.Thread(target=receive, daemon=True)
    th.start()
    rows: dict[str, list[tuple[float, float]]] = {"export": [], "wire": [], "import": []}
    try:
        push.send_multipart([b"warm", b"x"])
        ready.wait(5)
        for _ in range(repeats):
            for n in sizes:
                nb = -(-n // bs)
                rng.shuffle(blocks)
                src, dst = blocks[:nb], blocks[nb:2 * nb]
                t0 = time.perf_counter()
                payload = export_kv(runner.kv_caches, src, bs, 0, n)
                buf = payload.buffer()
                t1 = time.perf_counter()
                ready.clear()
                push.send_multipart([b"kv", buf], copy=False)
                ready.wait(30)
                t2, frames = got[-1]
                t3 = time.perf_counter()
                back = KVPayload.from_buffer(frames[1], n, payload.dtype, payload.shape)
                import_kv(runner.kv_caches, dst, bs, 0, back)
                t4 = time.perf_counter()
                nbytes = float(payload.nbytes)
                rows["export"].append((nbytes, t1 - t0))
                rows["wire"].append((nbytes, t2 - t1))
                rows["import"].append((nbytes, t4 - t3))
        push.send_multipart([b"stop", b""])
        th.join(5)
    finally:
        push.close(linger=0)
        pull.close(linger=0)
    fits = {}
    for side, pts in rows.items():
        by: dict[float, list[float]] = {}
        for b, t in pts:
            by.setdefault(b, []).append(t)
        xs = sorted(by)
        fits[side] = _linear_fit(xs, [statistics.median(by[x]) for x in xs])
    wire_lat, wire_slope = fits["wire"]
    return {"bandwidth_bytes_per_s": 1.0 / wire_slope, "latency_s": wire_lat,
            "export_s": fits["export"][0], "export_bytes_per_s": 1.0 / fits["export"][1],
            "import_s": fits["import"][0], "import_bytes_per_s": 1.0 / fits["import"][1],
            "sizes_tokens": sizes,
            "source": "measured: engine export_kv -> ZeroMQ PUSH/PULL over TCP loopback -> import_kv"}


# Steps the interference measurement times (victims) and what the co-running engine process repeats.
_VICTIMS = {"prefill": [Point("prefill", ((0, 256),)), Point("prefill", ((512, 64),))],
            "decode": [Point("decode", decodes=(512,)), Point("decode", decodes=(512,) * 4)]}
_CORUN = {"decode": Point("decode", decodes=(512, 512)), "prefill": Point("prefill", ((0, 256),))}


def _corunner(cfg_dict: dict, threads: int | None, kind: str, ready, stop) -> None:
    """Child process: load the engine and run `_CORUN[kind]` steps back to back until told to stop."""
    if threads:
        torch.set_num_threads(threads)
    cfg = EngineConfig(**cfg_dict)
    runner = ModelRunner(cfg)
    bench = _Bench(runner, random.Random(1))
    p = _CORUN[kind]
    for _ in range(3):
        bench.run(p)
    ready.set()
    while not stop.is_set():
        bench.run(p)


def measure_interference(cfg: EngineConfig, bench: _Bench, threads: int | None, rounds: int = 5,
                         progress: Callable[[int, int], None] | None = None) -> dict:
    """How much slower a step runs while another engine process on this host steps (CPU: shared cores,
    caches, memory bandwidth). In a 1P+1D deployment a prefill step overlaps the decode worker's steps and a
    decode step the prefill worker's, so prefill steps are timed beside a process repeating a decode step
    (2 sequences, context 512) and decode steps beside one repeating a 256-token prefill chunk. Factor =
    median co-run time / median solo time over `_VICTIMS`, solo and co-run rounds alternating."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    fits = [p for ps in _VICTIMS.values() for p in ps
            if p.tokens <= bench.runner.cfg.max_num_batched_tokens and p.blocks(bench.runner.block_size) * 2
            <= bench.runner.num_blocks and all(h + n <= (cfg.max_model_len or 1 << 30) for h, n in p.prefills)]
    solo: dict[Point, list[float]] = {p: [] for p in fits}
    co: dict[Point, list[float]] = {p: [] for p in fits}
    total, done = 2 * rounds * 2, 0
    cfg_dict = dataclasses.asdict(cfg)
    for victim_kind, co_kind in (("prefill", "decode"), ("decode", "prefill")):
        pts = [p for p in fits if p.kind == victim_kind]
        if not pts:
            continue
        ready, stop = ctx.Event(), ctx.Event()
        proc = ctx.Process(target=_corunner, args=(cfg_dict, threads, co_kind, ready, stop), daemon=True)
        for r in range(rounds):
            for p in pts:
                solo[p].append(bench.run(p))
            done += 1
            if r == 0:
                proc.start()
                if not ready.wait(120):
                    proc.kill()
                    raise RuntimeError("the co-running engine process did not start")
            for p in pts:
                co[p].append(bench.run(p))
            done += 1
            if progress:
                progress(done, total)
        stop.set()
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    out: dict = {"source": "measured: steps timed beside a second engine process stepping (1 thread each)",
                 "points": []}
    for kind in ("prefill", "decode"):
        ratios = []
        for p in fits:
            if p.kind == kind and solo[p] and co[p]:
                a, b = statistics.median(solo[p]), statistics.median(co[p])
                ratios.append(b / a)
                out["points"].append({**p.to_dict(), "solo_s": a, "corun_s": b, "factor": b / a})
        out[kind] = max(1.0, statistics.median(ratios)) if ratios else 1.0
    return out


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_info(device: torch.device) -> dict:
    """What the profile was measured on: CPU model, cores and torch threads, or the CUDA device."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return {"type": "cuda", "name": props.name, "memory_bytes": int(props.total_memory),
                "capability": f"{props.major}.{props.minor}", "cuda": torch.version.cuda}
    return {"type": "cpu", "name": _cpu_name(), "cores": os.cpu_count(), "threads": torch.get_num_threads(),
            "machine": platform.machine()}


def _param_count(runner: ModelRunner) -> int:
    return int(sum(p.numel() for p in runner.model.parameters()))


# ------------------------------------------------------------------------------------------- profile


def profile(model: str, options: ProfileOptions | None = None, progress: Progress | None = None) -> Profile:
    """Load `model` in a ModelRunner, time the training and held-out grids, fit, and return the Profile."""
    opt = options or ProfileOptions()
    threads = torch.get_num_threads()
    if opt.threads is not None:
        torch.set_num_threads(opt.threads)
    try:
        return _profile(model, opt, progress)
    finally:
        torch.set_num_threads(threads)


def _load_avg() -> float | None:
    """The 1-minute load average (other jobs competing for the cores make timings noisy), if known."""
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


def _profile(model: str, opt: ProfileOptions, progress: Progress | None) -> Profile:
    t_start = time.perf_counter()
    load_before = _load_avg()
    cfg = EngineConfig(model=model, dtype=opt.dtype, device=opt.device, block_size=opt.block_size,
                       max_num_batched_tokens=opt.max_num_batched_tokens, max_num_seqs=opt.max_num_seqs,
                       kv_cache_memory_bytes=opt.kv_cache_memory_bytes, num_kv_blocks=opt.num_kv_blocks,
                       attention_backend=opt.attention_backend, seed=opt.seed)
    if progress:
        progress("loading model", 0, 1)
    runner = ModelRunner(cfg)
    mc = runner.model_config
    capacity = runner.num_blocks * runner.block_size
    engine_max_len = cfg.max_model_len or mc.max_position_embeddings
    max_len = min(engine_max_len, capacity)
    if opt.max_len is not None:
        max_len = min(max_len, opt.max_len)
    if opt.quick:
        max_len = min(max_len, 1024)
    if max_len < 2:
        raise ValueError(f"cannot profile sequences of at most {max_len} token(s)")
    budget = min(cfg.max_num_batched_tokens, max_len - 1)
    max_seqs = min(cfg.max_num_seqs, 64 if opt.quick else cfg.max_num_seqs)
    rng = random.Random(opt.seed)
    bs = runner.block_size
    train = train_grid(budget, max_len, max_seqs, capacity, quick=opt.quick, block_size=bs)
    held = heldout_grid(opt.n_heldout, budget, max_len, max_seqs, capacity, rng, block_size=bs)
    held = [p for p in held if p not in set(train)]

    bench = _Bench(runner, rng)
    warm = [Point("prefill", ((0, min(budget, 256)),)), Point("decode", decodes=(min(255, max_len - 1),) * min(8, max_seqs)),
            Point("mixed", ((min(64, max_len // 2), min(64, budget - 4)),), (min(63, max_len - 1),) * 4)]
    # Touch the whole KV pool once: a fresh allocation is mapped lazily, and the first write to every
    # page would otherwise be charged to whichever measured step reaches it first.
    for t in getattr(runner, "kv_caches", []):
        t.fill_(0)
    for i, p in enumerate(warm * 2):
        bench.run(p)
        if progress:
            progress("warming up", i + 1, 2 * len(warm))

    # Train and held-out steps are measured together, in random order, so that drifts in the machine's
    # load spread over every kind of step instead of biasing one.
    jobs = [("train", p) for p in train] + [("heldout", p) for p in held]
    rng.shuffle(jobs)
    runs = bench.measure([p for _, p in jobs], opt.n_repeats, opt.point_budget_s,
                         (lambda d, t: progress("measuring steps", d, t)) if progress else None)
    rows: list[dict] = []
    for (split_name, p), rs in zip(jobs, runs):
        rows.append({"split": split_name, **p.to_dict(), **dataclasses.asdict(p.shape()),
                     "seconds": statistics.median(rs), "runs": rs})

    def split(name: str) -> tuple[list[BatchShape], list[float]]:
        sel = [r for r in rows if r["split"] == name]
        return [_shape(r) for r in sel], [r["seconds"] for r in sel]

    tr_s, tr_y = split("train")
    ho_s, ho_y = split("heldout")
    if progress:
        progress("fitting", 0, 1)
    meta = {"model": model, "device": device_info(runner.device)["name"]}
    step = StepTimeModel.from_samples(tr_s, tr_y, budget, segments=opt.segments, meta=meta)
    held_err = step.errors(ho_s, ho_y)
    held_err["by_kind"] = {k: step.errors([s for s, r in zip(ho_s, _rows(rows, "heldout")) if r["kind"] == k],
                                          [y for y, r in zip(ho_y, _rows(rows, "heldout")) if r["kind"] == k])
                           for k in ("prefill", "decode", "mixed")}
    step.meta["heldout_error"] = {k: v for k, v in held_err.items() if k != "by_kind"}
    for r in rows:
        r["predicted"] = step.step_time(_shape(r))

    itemsize = torch.empty((), dtype=runner.dtype).element_size()
    kv_bytes = 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim * itemsize
    link = None
    if opt.measure_link:
        if progress:
            progress("KV path", 0, 1)
        try:
            link = measure_kv_path(runner, rng, max_tokens=min(max_len, budget))
        except Exception:                                    # no ZeroMQ here: the bare socket pair
            link = measure_kv_link()
        if progress:
            progress("KV path", 1, 1)
    interference = None
    if opt.measure_interference and runner.device.type == "cpu" and not opt.quick:
        interference = measure_interference(cfg, bench, opt.threads,
                                            progress=(lambda d, t: progress("interference", d, t)) if progress else None)
    ampd = step.ampd_cost_model(max_len, capacity, kv_bytes, cfg.max_num_seqs, link,
                                meta={"model": model, "gpu": meta["device"]})
    if progress:
        progress("fitting", 1, 1)
    model_cfg = {"architecture": mc.architecture, "layers": mc.num_hidden_layers, "hidden": mc.hidden_size,
                 "intermediate": mc.intermediate_size, "heads": mc.num_attention_heads,
                 "kv_heads": mc.num_key_value_heads, "head_dim": mc.head_dim, "vocab": mc.vocab_size,
                 "max_position_embeddings": mc.max_position_embeddings, "params": _param_count(runner),
                 "dtype": str(runner.dtype).removeprefix("torch.")}
    opts = dataclasses.asdict(opt)
    opts.update(repeats=opt.n_repeats, heldout=len(held), train_points=len(train), profiled_max_len=max_len,
                load_avg_before=load_before, load_avg_after=_load_avg())
    return Profile(
        model=str(model), device=device_info(runner.device), torch_version=torch.__version__,
        engine=dataclasses.asdict(cfg), model_config=model_cfg, step_model=step, ampd=ampd,
        num_blocks=runner.num_blocks, block_size=runner.block_size, kv_bytes_per_token=kv_bytes,
        max_model_len=engine_max_len, max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_num_seqs=cfg.max_num_seqs, heldout_error=held_err, train_error=step.meta["train_error"],
        kv_link=link or dict(DEFAULT_KV_LINK), interference=interference,
        measurements=rows, options=opts, wall_s=time.perf_counter() - t_start,
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))


def _rows(rows: Iterable[dict], split: str) -> list[dict]:
    return [r for r in rows if r["split"] == split]


def _shape(r: dict) -> BatchShape:
    return BatchShape(r["prefill_tokens"], r["prefill_attn_pairs"], r["prefill_kv_read_tokens"], r["num_prefill"],
                      r["num_decode"], r["decode_ctx_tokens"])
