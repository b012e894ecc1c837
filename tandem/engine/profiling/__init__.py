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
from tandem.engine.profiling.device import device_info
from tandem.engine.profiling.grids import Point, heldout_grid, train_grid
from tandem.engine.profiling.interference import measure_interference
from tandem.engine.profiling.kv_path import measure_kv_link, measure_kv_path
from tandem.engine.profiling.options import ProfileOptions
from tandem.engine.profiling.run import profile
from tandem.perf.step_model import Profile

__all__ = ["Point", "ProfileOptions", "Profile", "profile", "train_grid", "heldout_grid", "measure_kv_link",
           "measure_kv_path", "measure_interference", "device_info"]
