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

The package's names are imported when first used (PEP 562), so reading ProfileOptions (the knobs `tandem profile`'s
flags are built from) does not load torch.
"""
from __future__ import annotations

import importlib
from typing import Any

_WHERE = {"heldout_grid": "grids", "train_grid": "grids", "measure_kv_path": "kv_path", "ProfileOptions": "options",
          "profile": "run"}

__all__ = ["ProfileOptions", "profile", "train_grid", "heldout_grid", "measure_kv_path"]


def __getattr__(name: str) -> Any:
    """The package's public names, imported from their module when first asked for."""
    if name in _WHERE:
        return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
