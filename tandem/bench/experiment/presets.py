"""The named experiment specifications (`tandem experiment --preset`): demo, paper and ablation."""
from __future__ import annotations

import dataclasses
from typing import Any

from tandem.bench.experiment.spec import ExperimentError, ExperimentSpec

PRESETS: dict[str, ExperimentSpec] = {
    "demo": ExperimentSpec(
        name="demo", model="llama-3.1-70b", gpu="h20", workloads=["toolbench", "hotpotqa"],
        policies=["ampd", "dynamo", "vllm", "continuum"], rates=[0.8, 1.6, 2.4], sessions=60,
        # each policy's winner of the deployment search at 1.6 req/s on toolbench (hotpotqa agrees)
        deploys={"ampd": "P:tp4x1,D:tp4x1", "dynamo": "P:tp2x3,D:tp2x1",
                 "vllm": "C:tp8x1", "continuum": "C:tp8x1"},
    ),
    "paper": ExperimentSpec(
        name="paper", model="llama-3.1-70b", gpu="h20", workloads=["toolbench", "gaia", "hotpotqa", "dureader"],
        policies=["ampd", "dynamo", "vllm", "continuum"], rates=[0.8, 1.2, 1.6, 2.0, 2.4], sessions=100,
    ),
    "ablation": ExperimentSpec(
        name="ablation", model="llama-3.1-70b", gpu="h20", workloads=["dureader", "gaia"],
        policies=["ampd-no-ar-pr", "ampd-no-pr", "ampd"], rates=[2.0], sessions=100,
        share_deploy={"ampd-no-pr": "ampd", "ampd-no-ar-pr": "ampd"},
    ),
}
"""demo: small and fast, fixed 8-GPU deployments (no search); paper: the AMPD Fig. 4 grid for Llama-3.1-70B
on H20; ablation: AMPD Fig. 5 (DuReader and GAIA at 2 req/s, the variants on AMPD's chosen deployment)."""


def preset(name: str, **overrides: Any) -> ExperimentSpec:
    """A copy of PRESETS[name] with fields replaced by the non-None `overrides`."""
    if name not in PRESETS:
        raise ExperimentError(f"unknown preset {name!r} (valid: {', '.join(PRESETS)})")
    return dataclasses.replace(PRESETS[name], **{k: v for k, v in overrides.items() if v is not None})
