"""What an engine builds for a block-diffusion checkpoint: its diffusion decoder, checked against the options, and
Optimus's window latency T(c, b), from a profile or measured on the engine's own forward."""
from __future__ import annotations

from typing import Sequence

from tandem.core.types import COLOCATED
from tandem.engine.config import EngineConfig, EngineError
from tandem.engine.diffusion.engine_step import DiffusionDecoder
from tandem.engine.diffusion.llada_generate import DEFAULT_BLOCK_LENGTH
from tandem.engine.diffusion.unmasking import DllmConfig
from tandem.engine.diffusion.window_timing import measure_window_latency
from tandem.engine.model_runner import ModelRunner
from tandem.perf.profile_io import PerfFileError, WindowLatencyProfile, load_window_latency
from tandem.policy.optimus.chunk import ChunkMode, parse_chunk
from tandem.policy.optimus.latency import ChunkLatency


def load_latency_profile(config: EngineConfig) -> WindowLatencyProfile | None:
    """The dllm_latency section of the profile named by dllm_latency_profile (EngineError, one line, on a bad file),
    None without one."""
    if config.dllm_latency_profile is None:
        return None
    try:
        return load_window_latency(str(config.dllm_latency_profile), "dllm_latency_profile")
    except PerfFileError as e:
        raise EngineError(str(e)) from None


def window_latency(config: EngineConfig, profiled: WindowLatencyProfile | None, runner: ModelRunner,
                   block: int) -> ChunkLatency:
    """T(c, b) from the profile (EngineError when it was measured with other diffusion blocks), else measured now
    on this engine's forward."""
    if profiled is None:
        return measure_window_latency(runner.model, block, config.max_num_batched_tokens, runner.device,
                                      max_seqs=config.max_num_seqs)
    if profiled.block != block:
        raise EngineError(f"dllm_latency_profile {config.dllm_latency_profile}: measured with diffusion blocks of "
                          f"{profiled.block}, this engine decodes blocks of {block}")
    return ChunkLatency.from_profile(profiled)


def _check_autoregressive(config: EngineConfig) -> None:
    """EngineError when an autoregressive checkpoint is given diffusion options."""
    for name in ("dllm_block_length", "dllm_admission", "dllm_latency_profile"):
        if getattr(config, name) is not None:
            raise EngineError(f"{name} is for block-diffusion models; this checkpoint is autoregressive")


def _canvas_block(config: EngineConfig) -> int:
    """A LLaDA-style (bidirectional) checkpoint's block: Fast-dLLM's prefix cache as dLLM-Serve phases (default
    admission phase, delay_step 0, ρ 1); EngineError for the options that do not apply."""
    if parse_chunk(config.dllm_chunk).mode not in (ChunkMode.AUTO, ChunkMode.ELASTIC):
        raise EngineError(f"dllm_chunk {config.dllm_chunk} sizes Optimus's streaming windows, which need a "
                          f"block-causal model (SDAR): in a LLaDA-style bidirectional model every position attends "
                          f"to the whole canvas, masks after the active block included, so no position's K/V is "
                          f"final when it is committed; LLaDA runs Fast-dLLM's prefix cache as dLLM-Serve phases "
                          f"(dllm_admission, dllm_refresh_interval)")
    if config.dllm_latency_profile is not None:
        raise EngineError("dllm_latency_profile sizes Optimus's streaming windows, which a LLaDA-style "
                          "bidirectional model does not run (its steps are dLLM-Serve phases)")
    block = config.dllm_block_length or DEFAULT_BLOCK_LENGTH
    if block < 2:
        raise EngineError(f"dllm_block_length must be at least 2 for a LLaDA-style model, got {block}")
    return block


def build_decoder(config: EngineConfig, role: str, runner: ModelRunner, eos: Sequence[int],
                  max_model_len: int) -> DiffusionDecoder | None:
    """The diffusion decoder of a block-diffusion checkpoint (SDAR, LLaDA), None for an autoregressive one;
    EngineError when the options do not fit the model."""
    mc = runner.model_config
    canvas = mc.is_canvas_diffusion
    if not canvas and mc.diffusion_block_size is None:
        _check_autoregressive(config)
        return None
    if role != COLOCATED:
        raise EngineError("LLaDA-style models run on co-located workers (a request's first step is its prefill and "
                          "its first Refresh)" if canvas else
                          "block-diffusion models run on co-located workers (no prefill/decode disaggregation)")
    if canvas:
        block = _canvas_block(config)
    else:
        block = config.dllm_block_length or mc.diffusion_block_size
        if block != mc.diffusion_block_size:
            raise EngineError(f"dllm_block_length {block} is not supported by this model: it was trained with "
                              f"blocks of {mc.diffusion_block_size} (config.json block_size)")
    defaults = DllmConfig(block, config.dllm_unmasking_strategy, config.dllm_denoising_steps,
                          config.dllm_confidence_threshold)
    steps = defaults.dllm_denoising_steps
    if steps is not None and block % steps:
        raise EngineError(f"dllm_denoising_steps {steps} must divide the block length {block}")
    sparse = (config.sparse_kv(retention_default=1.0) if canvas
              else config.sparse_kv() if config.dllm_admission is not None else None)
    return DiffusionDecoder(runner.model, runner.kv_caches, config.block_size, block,
                            not canvas and config.dllm_chunk != "block", defaults, eos, max_model_len, runner.device,
                            config.max_num_logits, sparse, canvas=canvas)
