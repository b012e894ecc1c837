"""Reading a `--perf` file: a `tandem profile` output (Profile) or an AMPD cost-model JSON (AMPDCostModel).

Shared by the simulator (`tandem simulate --perf`) and the serving runtime (`tandem serve --perf`), so it
lives with the cost models both read.
"""
from __future__ import annotations

import json

from tandem.perf.ampd_cost import AMPDCostModel
from tandem.perf.step_model import Profile, is_profile_dict
from tandem.perf.window_profile import SECTION as DLLM_SECTION, WindowLatencyProfile

__all__ = ["PerfFileError", "load_perf", "load_window_latency", "WindowLatencyProfile"]


class PerfFileError(ValueError):
    """A --perf file that is not valid JSON, or neither a profile nor a cost model (one-line message)."""


def load_perf(path: str, label: str = "--perf") -> Profile | AMPDCostModel:
    """Read a --perf file: a `tandem profile` output or an AMPDCostModel JSON; PerfFileError (one line, starting
    with `label` and the path) otherwise."""
    try:
        with open(path) as f:
            d = json.load(f)
    except json.JSONDecodeError as e:
        raise PerfFileError(f"{label} {path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    try:
        if is_profile_dict(d):
            return Profile.from_dict(d)
        if isinstance(d, dict) and "pre" in d and "dec" in d:
            return AMPDCostModel.from_dict(d)
    except (ValueError, KeyError, TypeError) as e:
        raise PerfFileError(f"{label} {path}: {e}") from None
    raise PerfFileError(f"{label} {path}: neither a `tandem profile` output nor an AMPD cost-model JSON")


def load_window_latency(path: str, label: str = "--dllm-latency-profile") -> WindowLatencyProfile:
    """The `dllm_latency` section (T(c, b) of a block-diffusion engine) of a `tandem profile` output; PerfFileError
    (one line) when the file cannot be read, is not a profile, or has no such section."""
    try:
        prof = load_perf(path, label)
    except OSError as e:
        raise PerfFileError(f"{label} {path}: cannot read ({e.strerror or e})") from None
    if not isinstance(prof, Profile):
        raise PerfFileError(f"{label} {path}: an AMPD cost-model JSON, not a `tandem profile` output")
    if prof.dllm_latency is None:
        raise PerfFileError(f"{label} {path}: the profile has no {DLLM_SECTION} section (profile a block-diffusion "
                            f"checkpoint with `tandem profile`)")
    return prof.dllm_latency
