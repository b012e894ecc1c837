"""What each serving framework does around the measured kernels, from its documented defaults (vLLM V1 0.1x-0.2x,
SGLang 0.5.x, TRT-LLM 1.x on 80+ GiB GPUs): its token budget, sequence limit and which steps replay CUDA graphs."""
from __future__ import annotations

from dataclasses import dataclass

from tandem.perf.measured.source import FRAMEWORKS


@dataclass(frozen=True)
class FrameworkDefaults:
    """A framework's scheduler and graph defaults (the simulator's agg workers take these for `--policy vllm`)."""

    name: str
    max_num_batched_tokens: int     # chunked-prefill token budget a step
    max_num_seqs: int               # sequences running at once
    graph_max_tokens: int           # steps of at most this many query tokens replay a captured graph
    graph_decode_only: bool         # only decode-only steps are captured (else mixed steps too, piecewise)
    graph_max_tokens_tp4: int = 0   # the capture limit at tp >= 4 when it differs (0: the same)

    def graph_tokens(self, tp: int) -> int:
        """The largest captured step at tensor-parallel degree tp."""
        return self.graph_max_tokens_tp4 if tp >= 4 and self.graph_max_tokens_tp4 else self.graph_max_tokens


# vLLM V1 (vllm/engine/arg_utils.py get_batch_defaults, >= 70 GiB GPUs, online serving): 8192 batched tokens, 1024
# sequences; piecewise CUDA graphs cover mixed steps up to min(2 x max_num_seqs, 512) tokens (attention outside).
# SGLang 0.5.x (server_args.py): chunked_prefill_size 8192 on H100/H200; decode batches up to cuda_graph_max_bs
# (256 at tp < 4, 512 at tp >= 4) replay graphs; extend (prefill) batches run eagerly.
# TRT-LLM 1.x (LLM API defaults; not verified against a run): max_num_tokens 8192, max_batch_size 2048; decode-only
# batches up to the CUDA-graph batch limit (128 by default) replay graphs.
_DEFAULTS = {
    "vllm": FrameworkDefaults("vllm", 8192, 1024, 512, False),
    "sglang": FrameworkDefaults("sglang", 8192, 1024, 256, True, 512),
    "trtllm": FrameworkDefaults("trtllm", 8192, 2048, 128, True),
}
assert set(_DEFAULTS) == set(FRAMEWORKS)


def framework_defaults(name: str) -> FrameworkDefaults:
    """A framework's defaults; ValueError naming the valid ones for another name."""
    try:
        return _DEFAULTS[name]
    except KeyError:
        raise ValueError(f"--cost-framework must be one of {', '.join(FRAMEWORKS)}, got {name!r}") from None
