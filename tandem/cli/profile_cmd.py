"""`tandem profile`: measure this engine on this device and fit the simulator's cost models (docs/profiler.md).

    tandem profile --model models/tiny-qwen3-30m --out profile.json
    tandem simulate --perf profile.json --workload toolbench --deploy "P:tp1x1,D:tp1x1" \\
        --slo-ttft 2 --slo-itl 0.1

Prints a summary table with the held-out median and p90 relative error of the fitted step-time model.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tandem.cli.common import CLIError, csv_list, positive_int, seed_arg


def add_parser(sub) -> argparse.ArgumentParser:
    """Register `profile` on the subparsers `sub` of the tandem parser."""
    p = sub.add_parser("profile", help="measure the engine's step times on this device and fit its cost model",
                       description="Time prefill, decode and mixed steps of the PyTorch engine over lengths, "
                                   "histories and batch sizes, fit the step-time model and AMPD's cost functions, "
                                   "and write them as JSON for `tandem simulate --perf FILE` (docs/profiler.md).")
    p.add_argument("--model", required=True, metavar="PATH", help="Hugging Face checkpoint directory")
    p.add_argument("--out", default="profile.json", metavar="FILE", help="where to write the profile (default: %(default)s)")
    p.add_argument("--quick", action="store_true",
                   help="a small grid with sequences up to 1024 tokens (seconds on a tiny model): checks the pipeline")
    p.add_argument("--max-len", type=positive_int, default=None, metavar="N",
                   help="longest sequence profiled (default: the model's context, within the KV pool)")
    p.add_argument("--repeats", type=positive_int, default=None, metavar="K",
                   help="timed runs of every step; the median is kept (default: 3)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default: %(default)s)")
    p.add_argument("--threads", type=positive_int, default=None, metavar="N",
                   help="torch CPU threads (default: torch's; profile with what the server will use)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "float16", "bfloat16"),
                   help="compute dtype (default: %(default)s)")
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=2048, metavar="N",
                   help="the engine's token budget per step, the largest step measured (default: %(default)s)")
    p.add_argument("--max-num-seqs", type=positive_int, default=256, metavar="N",
                   help="the engine's most sequences per step (default: %(default)s)")
    p.add_argument("--num-kv-blocks", type=positive_int, default=None, metavar="N",
                   help="KV pool size in blocks (default: the engine's memory budget)")
    p.add_argument("--enforce-eager", action="store_true", help="CUDA: time decode steps eagerly (no CUDA graphs)")
    p.add_argument("--cuda-graph-sizes", type=csv_list(positive_int), default=None, metavar="1,2,4,8",
                   help="CUDA: decode batch sizes captured as CUDA graphs (default: 1,2,4,8,16,... up to "
                        "max-num-seqs, at most 512)")
    p.add_argument("--heldout", type=positive_int, default=None, metavar="N",
                   help="random held-out steps for the error estimate (default: 40; --quick: 16)")
    p.add_argument("--seed", type=seed_arg, default=0, help="seed of the grids and tokens (default: 0)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_profile)
    return p


class _Bar:
    """A rich progress bar on stderr with one task per stage of the profiler."""

    def __init__(self, enabled: bool) -> None:
        self.bar = None
        self.tasks: dict[str, int] = {}
        if enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
            self.bar = Progress(TextColumn("{task.description:<18}"), BarColumn(), MofNCompleteColumn(),
                                TimeElapsedColumn(), console=Console(stderr=True), transient=True)
            self.bar.start()

    def __call__(self, stage: str, done: int, total: int) -> None:
        if self.bar is None:
            return
        if stage not in self.tasks:
            self.tasks[stage] = self.bar.add_task(stage, total=total)
        self.bar.update(self.tasks[stage], completed=done, total=total)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _runs(prof) -> str:
    """The range of timed runs per step, e.g. '2-7'."""
    counts = [len(m.get("runs", ())) for m in prof.measurements] or [0]
    lo, hi = min(counts), max(counts)
    return str(lo) if lo == hi else f"{lo}-{hi}"


def summary_rows(prof) -> list[tuple[str, str]]:
    """(label, value) lines of the summary table."""
    mc, dev, he = prof.model_config, prof.device, prof.heldout_error
    devtxt = dev.get("name", dev.get("type", "?"))
    if dev.get("type") == "cpu":
        devtxt += f" ({dev.get('threads')} torch thread(s) of {dev.get('cores')} cores)"
    rows = [("model", f"{prof.name} ({mc['architecture']}, {mc['params']:,} params, {mc['layers']} layers, "
                      f"hidden {mc['hidden']}, {mc['heads']}/{mc['kv_heads']} heads, {mc['dtype']})"),
            ("device", f"{devtxt}, torch {prof.torch_version}"),
            ("KV pool", f"{prof.kv_capacity_tokens:,} tokens ({prof.num_blocks} blocks of {prof.block_size}), "
                        f"{prof.kv_bytes_per_token:,} B/token"),
            ("steps measured", f"{prof.options.get('train_points')} fit + {he.get('n')} held out, "
                               f"median of {_runs(prof)} runs each, sequences up to {prof.options.get('profiled_max_len')} tokens")]
    lb, la = prof.options.get("load_avg_before"), prof.options.get("load_avg_after")
    if lb is not None and la is not None:
        rows.append(("machine load (1 min)", f"{lb:.2f} before, {la:.2f} after (other jobs make timings noisy)"))
    for k in ("prefill", "decode", "mixed", "window"):
        e = (he.get("by_kind") or {}).get(k)
        if e and e.get("n"):
            rows.append((f"held-out {k}", f"median {_pct(e['median'])}, p90 {_pct(e['p90'])} (n={e['n']})"))
    rows += [("held-out error", f"median {_pct(he.get('median'))}, p90 {_pct(he.get('p90'))} (n={he.get('n')})"),
             ("training error", f"median {_pct(prof.train_error.get('median'))}, p90 {_pct(prof.train_error.get('p90'))}")]
    st = prof.step_model
    rows += [("decode step (1 seq, ctx 512)", f"{1e3 * st.decode_time(1, 512):.2f} ms"),
             ("decode step (32 seqs, ctx 512)", f"{1e3 * st.decode_time(32, 32 * 512):.2f} ms"),
             (f"prefill {min(1024, prof.max_num_batched_tokens)} tokens",
              f"{1e3 * st.prefill_time(0, min(1024, prof.max_num_batched_tokens)):.1f} ms"),
             ("KV link", f"{prof.kv_link['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s, "
                         f"{1e6 * prof.kv_link['latency_s']:.0f} us ({prof.kv_link.get('source', '?')})"),
             laps_boundary_row(prof),
             *window_latency_rows(prof),
             ("wall time", f"{prof.wall_s:.1f} s")]
    return rows


def window_latency_rows(prof) -> list[tuple[str, str]]:
    """A block-diffusion profile's T(c, b): its regimes, what it was fitted to, and its held-out relative error."""
    w = prof.dllm_latency
    if w is None:
        return []
    n_train = len(w.points("train")[0])
    bps = " / ".join(f"{b:g}" for b in w.breakpoints) or "none"
    he, te = w.heldout_error, w.train_error
    return [("diffusion T(c, b)", f"{len(w.coefs)} regimes in b*c, breakpoints {bps}, "
                                  f"{w.per_seq_s * 1e3:.3f} ms a sequence, {w.head_s * 1e6:.2f} us a sampled "
                                  f"row's LM head; fitted to {n_train} window "
                                  f"steps (block {w.block}, {w.context} cached tokens each), training median "
                                  f"{_pct(te.get('median'))}"),
            ("T(c, b) held-out error", f"median {_pct(he.get('median'))}, p90 {_pct(he.get('p90'))} "
                                       f"(n={he.get('n')})")]


def laps_boundary_row(prof) -> tuple[str, str]:
    """LAPS's T(L, H) fitted to the profile's prefill steps and its boundaries, or why it could not be fitted."""
    from tandem.policy.laps.cost import PrefillCostModel

    bw = prof.device.get("memory_bandwidth_bytes_per_s") or 0.0
    try:
        m = PrefillCostModel.from_profile(prof.measurements, prof.kv_bytes_per_token, float(bw))
    except ValueError as e:
        return "LAPS boundary", f"not fitted: {e}"
    return "LAPS boundary", (f"L_m prefill {m.prefill_boundary():.0f} tokens, re-prefill (H=1024) "
                             f"{m.reprefill_boundary(1024):.0f}; T = aL(L+2H)+bL+g_w L+g_r H with a {m.alpha:.3g}, "
                             f"b {m.beta:.3g}, g_w {m.gamma_w:.3g}, g_r {m.gamma_r:.3g} s (memory {bw / 1e9:.1f} GB/s)")


def cmd_profile(args) -> int:
    """Profile the engine, write the JSON, print the summary."""
    model = Path(args.model)
    if not model.is_dir():
        raise CLIError(f"--model {args.model}: not a checkpoint directory")
    out = Path(args.out)
    if out.is_dir():
        raise CLIError(f"--out {args.out} is a directory; give a file name")
    if not out.parent.exists():
        raise CLIError(f"--out {args.out}: folder {out.parent} does not exist")
    from tandem.engine.config import EngineError
    from tandem.engine.loader import ModelLoadError
    from tandem.engine.profiling import ProfileOptions, profile

    opts = ProfileOptions(quick=args.quick, max_len=args.max_len, repeats=args.repeats, device=args.device,
                          threads=args.threads, dtype=args.dtype, max_num_batched_tokens=args.max_num_batched_tokens,
                          max_num_seqs=args.max_num_seqs, num_kv_blocks=args.num_kv_blocks, heldout=args.heldout,
                          seed=args.seed, enforce_eager=args.enforce_eager,
                          cuda_graph_sizes=tuple(args.cuda_graph_sizes) if args.cuda_graph_sizes else None)
    bar = _Bar(not args.no_progress and sys.stderr.isatty())
    try:
        prof = profile(str(model), opts, bar)
    except (EngineError, ModelLoadError, ValueError, RuntimeError) as e:
        raise CLIError(f"cannot profile {args.model}: {e}") from None
    finally:
        bar.close()
    prof.to_json(out)
    from rich.console import Console
    from rich.table import Table
    t = Table(title=f"tandem profile · {prof.name}", show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column()
    for k, v in summary_rows(prof):
        t.add_row(k, v)
    Console(soft_wrap=False).print(t)
    he = prof.heldout_error
    print(f"held-out median error {_pct(he.get('median'))} (p90 {_pct(he.get('p90'))}); wrote {out}")
    return 0
