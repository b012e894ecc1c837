"""Offline deployment planner (AMPD §5, App. A): how many prefill and decode workers at which TP degree.

    from tandem.plan import PlanInputs, plan
    result = plan(PlanInputs("llama-3.1-70b", "h20", 16, sessions))
    result.best.pair.deploy      # 'P:tp4x2,D:tp8x1'

See docs/planner.md for the objective, the MILP and the approximations.
"""
import importlib

_EXPORTS = {"Measurement": "coefficients", "SimSpec": "coefficients", "Workload": "coefficients",
            "default_cache_dir": "coefficients", "PlanInputs": "planner", "PlanResult": "planner", "Ranked": "planner",
            "exhaustive": "planner", "plan": "planner", "DEGREES": "space", "Pair": "space", "PlanError": "space",
            "parse_pair": "space"}

__all__ = ["DEGREES", "Measurement", "Pair", "PlanError", "PlanInputs", "PlanResult", "Ranked", "SimSpec",
           "Workload", "default_cache_dir", "exhaustive", "parse_pair", "plan"]


def __getattr__(name: str):
    """The package's names, imported on first use: `tandem plan`'s parser reads plan.options without the MILP's
    scipy."""
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"tandem.plan.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'tandem.plan' has no attribute {name!r}")
