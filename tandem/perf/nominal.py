"""The nominal CPU roofline of a checkpoint: T_pre, T_dec and T_kv (AMPD Eq. 1-2) from its size at a nominal CPU rate.
Routing and the host tier's load-or-recompute choice need only their ratios and rough scale; `tandem profile`
replaces them with measured fits. The live runtime routes with it (tandem.runtime.costs); an offline engine with a
host tier prices recompute with it."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tandem.perf.ampd_cost import AMPDCostModel, dec_features, kv_features, pre_features

NOMINAL_FLOPS = 40e9          # per worker (a few CPU threads of fp32 GEMM)
NOMINAL_MEM_BPS = 10e9        # KV reads during attention
NOMINAL_LINK_BPS = 2e9        # a local socket between worker processes (docs/profiler.md measures ~2.3 GB/s)
STEP_OVERHEAD_S = 1e-3


def nominal_cost_model(params: int, layers: int, hidden: int, kv_bytes_per_token: int, max_len: int,
                       max_num_batched_tokens: int = 2048, tps: Sequence[int] = (1,)) -> AMPDCostModel:
    """AMPDCostModel from a roofline of the checkpoint at NOMINAL_FLOPS / NOMINAL_MEM_BPS, for each tensor-parallel
    degree in `tps` (a tp worker: tp ranks' compute and memory, split ideally; KV between any two of them over one
    link: a transfer goes driver to driver)."""
    def prefill(h: int, n: int, tp: int) -> float:
        steps = -(-n // max_num_batched_tokens)
        flops = 2 * params * n + 4 * layers * hidden * n * (h + n / 2)
        return steps * STEP_OVERHEAD_S + (flops / NOMINAL_FLOPS + h * kv_bytes_per_token / NOMINAL_MEM_BPS) / tp

    def decode(b: int, ctx: int, tp: int) -> float:
        return STEP_OVERHEAD_S + (2 * params * b / NOMINAL_FLOPS + ctx * kv_bytes_per_token / NOMINAL_MEM_BPS) / tp

    incr = sorted({int(v) for v in np.geomspace(1, max(2, max_len), 24)})
    hist = [0] + [h for h in (16 << i for i in range(30)) if h < max_len]
    pairs = [(h, n) for h in hist for n in incr if h + n <= max_len]
    pre = {tp: ([pre_features(h, n) for h, n in pairs], [prefill(h, n, tp) for h, n in pairs]) for tp in tps}
    ctxs = [c for c in (16 << i for i in range(30)) if c <= max_len] or [max_len]
    batches = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    dec = {tp: ([dec_features(b, b * c) for c in ctxs for b in batches],
                [decode(b, b * c, tp) for c in ctxs for b in batches]) for tp in tps}
    toks = [1, 16, 256, 4096, 65536]
    kv = ([kv_features(t) for t in toks], [5e-5 + t * kv_bytes_per_token / NOMINAL_LINK_BPS for t in toks])
    return AMPDCostModel.from_samples(pre, dec, {(a, b, same): kv for a in tps for b in tps for same in (True, False)},
                                      meta={"source": "nominal CPU roofline (tandem.runtime.costs)"})


def checkpoint_params(vocab: int, hidden: int, layers: int, intermediate: int) -> int:
    """Parameters of a dense decoder of these sizes (embeddings, attention and MLP), for the roofline."""
    return vocab * hidden + layers * (4 * hidden * hidden + 3 * hidden * intermediate)
