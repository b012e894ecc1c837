"""Optimus (../shared/papers/optimus-elastic-dllm-decoding.md): the chunk size of each block-diffusion step."""
from tandem.policy.optimus.chunk import (CHUNK_CANDIDATES, DEFAULT_CHUNK, REPRODUCIBLE_CHUNK, ChunkMode, ChunkSizer,
                                         ChunkSpec, SeqWindow, StepLatency, StepWindows, parse_chunk, request_chunk)
from tandem.policy.optimus.commit import CommitEstimator
from tandem.policy.optimus.latency import ChunkLatency

__all__ = ["CHUNK_CANDIDATES", "DEFAULT_CHUNK", "REPRODUCIBLE_CHUNK", "ChunkLatency", "ChunkMode", "ChunkSizer",
           "ChunkSpec", "CommitEstimator", "SeqWindow", "StepLatency", "StepWindows", "parse_chunk", "request_chunk"]
