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

from tandem.cli.args import add_knobs, knob_values
from tandem.cli.commands import COMMAND_HELP
from tandem.cli.common import CLIError, StderrBar, percent
from tandem.cli.options import OutputOptions, ProfileFiles
from tandem.engine.profiling.options import ProfileOptions


def add_parser(sub) -> argparse.ArgumentParser:
    """Register `profile` on the subparsers `sub` of the tandem parser."""
    p = sub.add_parser("profile", help=COMMAND_HELP["profile"],
                       description="Time prefill, decode and mixed steps of the PyTorch engine over lengths, "
                                   "histories and batch sizes, fit the step-time model and AMPD's cost functions, "
                                   "and write them as JSON for `tandem simulate --perf FILE` (docs/profiler.md). "
                                   "The largest step measured is --max-num-batched-tokens tokens.")
    add_knobs(p, ProfileFiles, required=("model",))
    add_knobs(p, ProfileOptions, ("quick", "max_len", "repeats", "device", "threads", "dtype", "tensor_parallel_size",
                                  "max_num_batched_tokens", "max_num_seqs", "num_kv_blocks", "enforce_eager",
                                  "cuda_graph_sizes", "heldout", "seed"))
    add_knobs(p, OutputOptions, ("no_progress",))
    p.set_defaults(func=cmd_profile)
    return p


class _Bar(StderrBar):
    """A progress bar with one task per stage of the profiler."""

    def __init__(self, enabled: bool) -> None:
        super().__init__(enabled, "{task.description:<18}")
        self.tasks: dict[str, int] = {}

    def __call__(self, stage: str, done: int, total: int) -> None:
        if self.bar is None:
            return
        if stage not in self.tasks:
            self.tasks[stage] = self.bar.add_task(stage, total=total)
        self.bar.update(self.tasks[stage], completed=done, total=total)


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
            rows.append((f"held-out {k}", f"median {percent(e['median'])}, p90 {percent(e['p90'])} (n={e['n']})"))
    rows += [("held-out error", f"median {percent(he.get('median'))}, p90 {percent(he.get('p90'))} (n={he.get('n')})"),
             ("training error", f"median {percent(prof.train_error.get('median'))}, p90 {percent(prof.train_error.get('p90'))}")]
    st = prof.step_model
    rows += [("decode step (1 seq, ctx 512)", f"{1e3 * st.decode_time(1, 512):.2f} ms"),
             ("decode step (32 seqs, ctx 512)", f"{1e3 * st.decode_time(32, 32 * 512):.2f} ms"),
             (f"prefill {min(1024, prof.max_num_batched_tokens)} tokens",
              f"{1e3 * st.prefill_time(0, min(1024, prof.max_num_batched_tokens)):.1f} ms"),
             ("KV link", f"{prof.kv_link['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s, "
                         f"{1e6 * prof.kv_link['latency_s']:.0f} us ({prof.kv_link.get('source', '?')})"),
             *collective_rows(prof),
             laps_boundary_row(prof),
             *window_latency_rows(prof),
             ("wall time", f"{prof.wall_s:.1f} s")]
    return rows


def collective_rows(prof) -> list[tuple[str, str]]:
    """The profiled degree, and the all-reduces measured on this host (a tp1 profile prices those rank counts)."""
    rows = [("tensor parallelism", f"tp{prof.tensor_parallel_size} (prices tp"
                                   f"{'/tp'.join(map(str, prof.priced_tps()))} workers)")]
    c = prof.collective
    if c is None:
        return rows
    fits = "; ".join(f"{n} ranks {1e6 * f.latency_s:.0f} us + {1e9 * f.per_byte_s:.3f} ns/B"
                     for n, f in sorted(c.fits.items()))
    rows.append(("all-reduces", f"{c.all_reduces_per_step} a step of {c.bytes_per_token} B a token ({c.backend}): "
                                f"{fits}"))
    if c.in_steps and c.in_steps.get("share_of_step") is not None:
        rows.append(("all-reduces in steps", f"{1e3 * c.in_steps['all_reduce_s_per_step']:.2f} ms a step, "
                                             f"{c.in_steps['share_of_step']:.0%} of the step"))
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
                                  f"{percent(te.get('median'))}"),
            ("T(c, b) held-out error", f"median {percent(he.get('median'))}, p90 {percent(he.get('p90'))} "
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
    from tandem.engine.profiling import profile

    opts = ProfileOptions(**knob_values(args, ProfileOptions))
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
    print(f"held-out median error {percent(he.get('median'))} (p90 {percent(he.get('p90'))}); wrote {out}")
    return 0
