"""tandem's C attention kernels per instruction set: this tree's against an older revision's, same run.

    python benchmarks/attention_isa.py [--base REV] [--isa native,avx2] [--threads 1] [--reps 30]
        [--out docs/results/attention_isa]

Builds csrc/paged_decode.c and csrc/paged_prefill.c of this tree and of --base (default 2e15c3a) for each ISA
(native: -march=native; avx2: -march=x86-64-v3, an AVX2-only target: tandem/engine/attention/isa.py) and times one
layer of the 30m Qwen3 (8 query heads, 4 KV heads, head dim 64, blocks of 32, as in benchmarks/engine_vs_vllm.py):
a decode step of 64 sequences at contexts 272-400 and prefill chunks of 256 and 512 tokens (the 512 after a cached
prefix of 256). Median ms of --reps calls, the builds alternating. Also says whether every build's outputs are
bit-identical to this tree's native build. Prints a table; writes results.json and table.md under --out.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CSRC = "tandem/engine/attention/csrc"
HQ, HKV, D, BS = 8, 4, 64, 32


def build(sources: dict[str, bytes], cap, out: Path) -> ctypes.CDLL:
    """A kernel library from the given csrc/ files at an ISA cap."""
    from tandem.engine.attention import native
    out.mkdir(parents=True, exist_ok=True)
    for name, text in sources.items():
        (out / name).write_bytes(text)
    so = out / "kernels.so"
    cc = native.compiler()
    subprocess.run([cc, *native.compile_flags(cap), "-o", str(so), str(out / "paged_decode.c"),
                    str(out / "paged_prefill.c"), "-lm"], check=True)
    return native.bind(ctypes.CDLL(str(so)))


def tree_sources(rev: str | None) -> dict[str, bytes]:
    """csrc/'s files as of `rev` (None: the working tree)."""
    if rev is None:
        return {p.name: p.read_bytes() for p in (REPO / CSRC).iterdir() if p.suffix in (".c", ".h")}
    names = subprocess.run(["git", "ls-tree", "--name-only", rev, f"{CSRC}/"], capture_output=True, text=True,
                           check=True, cwd=REPO).stdout.split()
    return {Path(n).name: subprocess.run(["git", "show", f"{rev}:{n}"], capture_output=True, check=True,
                                         cwd=REPO).stdout for n in names if n.endswith((".c", ".h"))}


def cases(torch):
    """(name, fn(lib, out) -> None, out tensor) for each timed call."""
    g = torch.Generator().manual_seed(0)
    nblocks = 64 * 14 + 1
    kv = torch.randn(2, nblocks, BS, HKV, D, generator=g)
    out = []
    lens = torch.linspace(272, 400, 64).long()
    bt = torch.arange(1, 64 * 13 + 1, dtype=torch.int32).reshape(64, 13)
    qd = torch.randn(64, HQ, D, generator=g)
    rows = torch.arange(64)

    def decode(lib, o):
        lib.tandem_paged_decode(qd.data_ptr(), kv.data_ptr(), bt.data_ptr(), bt.shape[1], rows.data_ptr(),
                                rows.data_ptr(), lens.data_ptr(), 64, nblocks, BS, HQ, HKV, D, D ** -0.5, o.data_ptr(),
                                torch.get_num_threads())
    out.append(("decode 64 seqs x ctx 272-400", decode, torch.empty_like(qd)))
    for n, prefix in ((256, 0), (512, 256)):
        qp = torch.randn(n, HQ, D, generator=g)
        one = torch.zeros(1, dtype=torch.long)
        ql, sl = torch.tensor([n]), torch.tensor([n + prefix])

        def prefill(lib, o, qp=qp, ql=ql, sl=sl):
            lib.tandem_paged_prefill(qp.data_ptr(), kv.data_ptr(), bt.data_ptr(), bt.shape[1], one.data_ptr(),
                                     ql.data_ptr(), one.data_ptr(), sl.data_ptr(), 1, nblocks, BS, HQ, HKV, D,
                                     D ** -0.5, o.data_ptr(), torch.get_num_threads())
        out.append((f"prefill {n} tokens" + (f" after {prefix}" if prefix else ""), prefill, torch.empty_like(qp)))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="2e15c3a")
    ap.add_argument("--isa", default="native,avx2")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default="docs/results/attention_isa")
    a = ap.parse_args(argv)
    import torch

    from tandem.bench.host import describe_host
    from tandem.engine.attention.isa import parse_isa_cap
    torch.set_num_threads(a.threads)
    try:
        caps = [(n, parse_isa_cap(n)) for n in a.isa.split(",")]
    except ValueError as e:
        ap.error(str(e))
    work = Path(tempfile.mkdtemp(prefix="attention-isa-"))
    libs = {}
    for src_name, rev in (("this tree", None), (f"base {a.base}", a.base)):
        for isa, cap in caps:
            libs[(src_name, isa)] = build(tree_sources(rev), cap, work / f"{len(libs)}")
    widths = {k: (lib.tandem_simd_width() if hasattr(lib, "tandem_simd_width") else None) for k, lib in libs.items()}
    rows = []
    for name, fn, o in cases(torch):
        ref = o.clone()
        fn(libs[("this tree", caps[0][0])], ref)
        times = {k: [] for k in libs}
        same = {}
        for _ in range(a.reps):
            for k, lib in libs.items():
                o.zero_()
                t0 = time.perf_counter()
                fn(lib, o)
                times[k].append(time.perf_counter() - t0)
                same[k] = bool(torch.equal(o, ref))
        for k in libs:
            rows.append({"case": name, "source": k[0], "isa": k[1], "vector_floats": widths[k],
                         "ms": 1e3 * statistics.median(times[k]), "identical_to_first": same[k]})
    lines = ["| case | source | ISA | vector floats | ms (median) | outputs bit-identical to this tree's "
             f"{caps[0][0]} build |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['case']} | {r['source']} | {r['isa']} | {r['vector_floats'] or '-'} | {r['ms']:.3f} | "
              f"{'yes' if r['identical_to_first'] else 'no'} |" for r in rows]
    table = "\n".join(lines)
    host = describe_host()
    print(f"host: {host.line()}; {a.threads} thread(s)\n{table}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"command": "python benchmarks/attention_isa.py "
                                                  + " ".join(sys.argv[1:] if argv is None else argv),
                                                  "host": host.as_dict(), "threads": a.threads, "rows": rows},
                                                 indent=2) + "\n")
    (out / "table.md").write_text(f"host: {host.line()}; {a.threads} thread(s)\n\n{table}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
