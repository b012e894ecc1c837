"""LAPS (length-aware prefill) policies, sans-I/O: cost model and boundary, classifier, graph buckets, AWD, pools."""
from tandem.policy.laps.awd import AWDBatcher, AWDConfig, Decision, DispatchReason, ShortRequest
from tandem.policy.laps.buckets import Bucket, BucketGrid
from tandem.policy.laps.classify import DEFAULT_THRESHOLD, LengthClassifier, PrefillClass
from tandem.policy.laps.cost import PrefillCostModel
from tandem.policy.laps.pressure import InstanceSignal, Move, PoolController, PressureConfig, exceeds

__all__ = [
    "AWDBatcher", "AWDConfig", "Bucket", "BucketGrid", "DEFAULT_THRESHOLD", "Decision", "DispatchReason",
    "InstanceSignal", "LengthClassifier", "Move", "PoolController", "PrefillClass", "PrefillCostModel",
    "PressureConfig", "ShortRequest", "exceeds",
]
