"""Tensor parallelism: a worker as a group of ranks (Megatron's sharding, vLLM's driver rank). docs/engine.md."""
from tandem.engine.parallel.group import SINGLE, TPGroup, building, check_shardable, current_group

__all__ = ["SINGLE", "TPGroup", "building", "check_shardable", "current_group"]
