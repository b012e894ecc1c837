"""perf: cost models — hardware and model catalogues, the roofline, piecewise alpha-beta fits,
and AMPD's T_pre / T_dec / T_kv. See docs/cost-models.md."""
from tandem.perf.errors import DoesNotFitError, ParallelismError, UnknownNameError
from tandem.perf.hardware import GPU, GPUS, get_gpu
from tandem.perf.models import MODELS, ModelSpec, get_model
from tandem.perf.batch_shape import BatchShape
from tandem.perf.roofline import (Roofline, check_tp, kv_bytes_per_token_per_gpu, kv_capacity_tokens,
                                  kv_transfer_time, supported_tps)
from tandem.perf.fit import PiecewiseLinear, fit
from tandem.perf.ampd_cost import AMPDCostModel, dec_features, kv_features, pre_features

__all__ = [
    "AMPDCostModel", "BatchShape", "DoesNotFitError", "GPU", "GPUS", "MODELS", "ModelSpec", "ParallelismError",
    "PiecewiseLinear", "Roofline", "UnknownNameError", "check_tp", "dec_features", "fit", "get_gpu", "get_model",
    "kv_bytes_per_token_per_gpu", "kv_capacity_tokens", "kv_features", "kv_transfer_time", "pre_features",
    "supported_tps",
]
