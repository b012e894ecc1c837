"""Offline deployment planner (AMPD §5, App. A): how many prefill and decode workers at which TP degree.

    from tandem.plan import PlanInputs, plan
    result = plan(PlanInputs("llama-3.1-70b", "h20", 16, sessions))
    result.best.pair.deploy      # 'P:tp4x2,D:tp8x1'

See docs/planner.md for the objective, the MILP and the approximations.
"""
from tandem.plan.coefficients import Measurement, SimSpec, Workload, default_cache_dir
from tandem.plan.planner import PlanInputs, PlanResult, Ranked, exhaustive, plan
from tandem.plan.space import DEGREES, Pair, PlanError, parse_pair

__all__ = ["DEGREES", "Measurement", "Pair", "PlanError", "PlanInputs", "PlanResult", "Ranked", "SimSpec",
           "Workload", "default_cache_dir", "exhaustive", "parse_pair", "plan"]
