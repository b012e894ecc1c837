"""The CPU paged decode kernel against an earlier version of its source, same run, on a cold and a warm cache.

    python benchmarks/paged_decode_versions.py [--base d1b1ccf] [--shapes 34x300,64x400] [--calls 10]
        [--out docs/results/paged_decode_versions]

Both sources (the working tree's tandem/engine/attention/csrc/paged_decode.c and the one at --base) are compiled
here with the engine's flags and called through ctypes on the same inputs: the 30m model's layer shape (8 query heads,
4 KV heads, head dim 64, blocks of 16), SxL = S decode sequences of about L tokens with their blocks shuffled over
a pool, 8 such KV tensors (one per layer, as in a step). Cold: a 64 MB buffer is written between calls, as a step's
weights evict the KV between layers; warm: the same tensor called again. The versions alternate call by call; the
median ms per call and the outputs' largest difference are reported. Writes results.json, table.md and a PNG.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HQ, HKV, D, BS = 8, 4, 64, 16


def _build(src: str, out: Path):
    from tandem.engine.attention import native
    cc = native.compiler()
    if cc is None:
        raise SystemExit("paged_decode_versions.py: no C compiler on PATH")
    c = out.with_suffix(".c")
    c.write_text(src)
    subprocess.run([cc, *native.compile_flags(None), "-I", str(native.SOURCE.parent), "-o", str(out), str(c), "-lm"],
                   check=True)
    return native.bind(ctypes.CDLL(str(out))).tandem_paged_decode


def _shape(text: str) -> tuple[int, int]:
    try:
        s, n = (int(x) for x in text.lower().split("x"))
    except ValueError:
        s = n = 0
    if not (1 <= s <= 1024 and 1 <= n <= 32768):
        print(f"paged_decode_versions.py: error: a shape is SxL with S in 1..1024 and L in 1..32768, got {text!r}",
              file=sys.stderr)
        sys.exit(2)
    return s, n


def measure(fns: dict, s: int, n: int, calls: int) -> dict:
    """Median ms per call of each version, cold and warm, and the largest output difference between them."""
    import torch
    g = torch.Generator().manual_seed(0)
    nb = -(-n // BS)
    pool = s * nb + 8
    blocks = list(range(pool))
    random.Random(0).shuffle(blocks)
    bt = torch.tensor([blocks[i * nb:(i + 1) * nb] for i in range(s)], dtype=torch.int32)
    rows, seqs = torch.arange(s), torch.arange(s)
    lens = torch.tensor([n - (i % 7) for i in range(s)])
    kvs = [torch.randn(2, pool, BS, HKV, D, generator=g) for _ in range(8)]
    q = torch.randn(s, HQ, D, generator=g)
    junk = torch.zeros(16 << 20)
    outs = {k: torch.empty_like(q) for k in fns}

    def call(name: str, kv) -> float:
        t = time.perf_counter()
        fns[name](q.data_ptr(), kv.data_ptr(), bt.data_ptr(), bt.shape[1], rows.data_ptr(), seqs.data_ptr(),
                  lens.data_ptr(), s, pool, BS, HQ, HKV, D, D ** -0.5, outs[name].data_ptr(), 1)
        return time.perf_counter() - t

    res = {k: {"cold": [], "warm": []} for k in fns}
    for _ in range(calls):
        for kv in kvs:
            for name in fns:
                junk.add_(1.0)
                res[name]["cold"].append(call(name, kv))
                res[name]["warm"].append(call(name, kv))
    diff = max((outs[a] - outs[b]).abs().max().item() for a in fns for b in fns)
    return {"shape": f"{s}x{n}", "max_abs_diff": diff,
            **{k: {m: 1e3 * statistics.median(v[m]) for m in ("cold", "warm")} for k, v in res.items()}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="d1b1ccf", help="git revision of the earlier source (default d1b1ccf)")
    ap.add_argument("--shapes", default="34x300,64x400")
    ap.add_argument("--calls", type=int, default=10, help="rounds over the 8 layers (default 10)")
    ap.add_argument("--out", default="docs/results/paged_decode_versions")
    args = ap.parse_args(argv)
    shapes = [_shape(t) for t in args.shapes.split(",") if t.strip()]
    if not shapes or not 1 <= args.calls <= 1000:
        print("paged_decode_versions.py: error: give at least one shape and --calls in 1..1000", file=sys.stderr)
        return 2
    rel = "tandem/engine/attention/csrc/paged_decode.c"
    r = subprocess.run(["git", "show", f"{args.base}:{rel}"], cwd=REPO, capture_output=True, text=True)
    if r.returncode != 0:
        print(f"paged_decode_versions.py: error: --base {args.base}: {r.stderr.strip()}", file=sys.stderr)
        return 2
    import torch
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        fns = {args.base: _build(r.stdout, Path(tmp) / "base.so"),
               "working tree": _build((REPO / rel).read_text(), Path(tmp) / "head.so")}
        rows = [measure(fns, s, n, args.calls) for s, n in shapes]
    lines = ["| shape | cache | " + " | ".join(f"{k} ms" for k in fns) + " | ratio |", "|---|---|---|---|---|"]
    for row in rows:
        for m in ("cold", "warm"):
            a, b = (row[k][m] for k in fns)
            lines.append(f"| {row['shape']} | {m} | {a:.3f} | {b:.3f} | {a / b:.2f}x |")
    table = "\n".join(lines)
    print(table)
    out = REPO / args.out if not Path(args.out).is_absolute() else Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M %Z"), "base": args.base, "calls": args.calls}
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    (out / "table.md").write_text(f"{meta}\n\n{table}\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    labels = [f"{row['shape']} {m}" for row in rows for m in ("cold", "warm")]
    for j, k in enumerate(fns):
        ax.bar([i + (j - 0.5) * 0.38 for i in range(len(labels))], [row[k][m] for row in rows for m in ("cold", "warm")],
               0.38, label=k)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel("ms per layer call (median)")
    ax.set_title("paged decode kernel: earlier source vs working tree")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "paged_decode_versions.png", dpi=120)
    plt.close(fig)
    return 0


if __name__ == "__main__":
    sys.exit(main())
