"""Reading a `--perf` file: a `tandem profile` output (Profile) or an AMPD cost-model JSON (AMPDCostModel).

Shared by the simulator (`tandem simulate --perf`) and the serving runtime (`tandem serve --perf`), so it
lives with the cost models both read.
"""
from __future__ import annotations

import json

from tandem.perf.ampd_cost import AMPDCostModel
from tandem.perf.step_model import Profile, is_profile_dict

__all__ = ["PerfFileError", "load_perf"]


class PerfFileError(ValueError):
    """A --perf file that is not valid JSON, or neither a profile nor a cost model (one-line message)."""


def load_perf(path: str) -> Profile | AMPDCostModel:
    """Read a --perf file: a `tandem profile` output or an AMPDCostModel JSON; PerfFileError (one line) otherwise."""
    try:
        with open(path) as f:
            d = json.load(f)
    except json.JSONDecodeError as e:
        raise PerfFileError(f"--perf {path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    try:
        if is_profile_dict(d):
            return Profile.from_dict(d)
        if isinstance(d, dict) and "pre" in d and "dec" in d:
            return AMPDCostModel.from_dict(d)
    except (ValueError, KeyError, TypeError) as e:
        raise PerfFileError(f"--perf {path}: {e}") from None
    raise PerfFileError(f"--perf {path}: neither a `tandem profile` output nor an AMPD cost-model JSON")
