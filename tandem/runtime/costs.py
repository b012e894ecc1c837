"""The coordinator's cost estimates for routing when no `tandem profile` file is given: a CPU roofline.

T_pre, T_dec and T_kv (AMPD Eq. 1-2) from the checkpoint's size at a nominal CPU rate. Routing needs
only their ratios and rough scale; `tandem serve --perf PROFILE` replaces them with measured fits.
"""
from __future__ import annotations

from collections.abc import Sequence

from tandem.perf.nominal import (  # noqa: F401 - the nominal figures, re-exported
    NOMINAL_FLOPS, NOMINAL_LINK_BPS, NOMINAL_MEM_BPS, STEP_OVERHEAD_S, checkpoint_params, nominal_cost_model,
)


def serving_cost_model(model: str, kv_bytes_per_token: int, max_len: int, perf: str | None = None,
                       tps: Sequence[int] = (1,)):
    """The cost model the coordinator routes with and every worker estimates its queue with (AMPD Eq. 1-2):
    the `tandem profile` fit when given (`--perf`; ValueError, one line, when it has no fit for a degree in `tps`),
    else the nominal roofline of the checkpoint at the deployment's tensor-parallel degrees `tps`."""
    if perf:
        from tandem.perf.profile_io import load_perf
        prof = load_perf(perf)
        if hasattr(prof, "cost_model"):              # a `tandem profile` output: the degrees it prices
            try:
                return prof.cost_model(tps)
            except ValueError as e:
                raise ValueError(f"--perf {perf}: {e}") from None
        cost = prof
        missing = sorted(set(tps) - set(getattr(cost, "tps", (1,))))
        if missing:
            raise ValueError(f"--perf {perf} has no fit for tp{missing[0]} (profile the model at that "
                             f"tensor-parallel degree)")
        return cost
    from tandem.engine.models import ModelConfig
    mc = ModelConfig.from_pretrained(model)
    params = checkpoint_params(mc.vocab_size, mc.hidden_size, mc.num_hidden_layers, mc.intermediate_size)
    return nominal_cost_model(params, mc.num_hidden_layers, mc.hidden_size, int(kv_bytes_per_token), max_len,
                              tps=tuple(sorted(set(tps))))
