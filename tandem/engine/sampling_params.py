"""Per-request sampling parameters with vLLM's names, defaults and validation.

Parameters are checked once, when the request is made, so the sampler and the stop checker can
trust them. `stop` is normalised to a list of strings and `stop_token_ids` to a list of ints; `logit_bias` (OpenAI's
token id -> bias in [-100, 100], at most MAX_LOGIT_BIAS entries) to a dict of int -> float, None when empty.
A positive temperature below 0.01 is raised to 0.01 as vLLM does (smaller ones overflow to inf/nan
in the scaled logits); temperature 0 means greedy.
"""
from __future__ import annotations

import copy
import math
import numbers
from dataclasses import dataclass
from typing import Any

from tandem.engine.structured_output import StructuredOutput, StructuredOutputError, shorten
from tandem.policy.optimus.chunk import MAX_FIXED_CHUNK, parse_chunk

MAX_LOGPROBS = 20          # the most top logprobs a request may ask for (vLLM's default max_logprobs)
MIN_TEMPERATURE = 1e-2     # positive temperatures below this are raised to it (vLLM's _MAX_TEMP)
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1     # seed range (a signed 64-bit integer, as vLLM and torch take)
INT32_MAX = (1 << 31) - 1  # top_k, token ids (stop_token_ids): no tokenizer has more ids
MAX_LOGIT_BIAS = 1024      # entries a logit_bias may have: vLLM's cap (MAX_NUM_LOGIT_BIAS_TOKENS of its Model
                           # Runner V2 sampler's logit-bias state); the server also caps it at the vocabulary
MAX_BIAS = 100.0           # |bias| a logit_bias entry may add (OpenAI's range [-100, 100])


class SamplingParamsError(ValueError):
    """An invalid sampling parameter; the message names the field and the bad value."""


def _bad(field: str, value: Any, why: str) -> SamplingParamsError:
    return SamplingParamsError(f"{field} {why}, got {shorten(value)}")


def _is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _is_finite(x: Any) -> bool:
    """A real number that is finite as a float (an int beyond float range is not)."""
    try:
        return _is_real(x) and math.isfinite(float(x))
    except OverflowError:
        return False


UNMASKING_STRATEGIES = ("low_confidence_dynamic", "low_confidence_static", "sequential")   # LMDeploy's names
_NOT_FOR_DIFFUSION = {"min_p": 0.0, "min_tokens": 0, "logprobs": None, "prompt_logprobs": None,
                      "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
                      "structured_output": None, "logit_bias": None}


@dataclass
class SamplingParams:
    """How to sample one request's tokens and when to stop it (vLLM's SamplingParams subset)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                                  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16                     # None: until the context limit
    min_tokens: int = 0
    stop: str | list[str] | None = None             # normalised to a list
    stop_token_ids: list[int] | None = None         # normalised to a list
    ignore_eos: bool = False
    logprobs: int | None = None                     # None: none; k: chosen token's + top k
    prompt_logprobs: int | None = None              # None: none; k: each prompt token's logprob + top k (vLLM)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    structured_output: StructuredOutput | None = None   # JSON object / schema (a dict of its fields is converted)
    logit_bias: dict[int, float] | None = None      # token id -> bias added to its logit before sampling
    # block-diffusion models only (LMDeploy's names; None: the engine's setting)
    dllm_block_length: int | None = None            # must be the engine's block length (one per engine)
    dllm_unmasking_strategy: str | None = None      # low_confidence_dynamic, low_confidence_static, sequential
    dllm_denoising_steps: int | None = None         # steps per block: must divide the block length
    dllm_confidence_threshold: float | None = None  # in (0, 1]: the dynamic strategy commits what passes it
    dllm_chunk: str | None = None                   # auto, elastic, block or N (tandem's; None: the engine's)

    def __post_init__(self) -> None:
        self._check_numbers()
        self._check_dllm()
        self._check_stops()
        self._check_logit_bias()
        so = self.structured_output
        try:
            self.structured_output = StructuredOutput.from_dict(so) if isinstance(so, dict) else so
        except StructuredOutputError as e:
            raise SamplingParamsError(f"structured_output: {e}") from None
        if not isinstance(self.structured_output, (StructuredOutput, type(None))):
            raise _bad("structured_output", so, "must be None or a StructuredOutput")

    def _check_numbers(self) -> None:
        if not _is_int(self.n) or self.n != 1:
            raise _bad("n", self.n, "must be 1 (only one sequence per request is supported)")
        if not _is_finite(self.temperature) or self.temperature < 0:
            raise _bad("temperature", self.temperature, "must be a finite number >= 0")
        self.temperature = float(self.temperature)
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise _bad("top_p", self.top_p, "must be in (0, 1]")
        self.top_p = float(self.top_p)
        if not _is_int(self.top_k) or not -1 <= self.top_k <= INT32_MAX:
            raise _bad("top_k", self.top_k, f"must be an int in [-1, {INT32_MAX}] (0 or -1 disable it)")
        self.top_k = int(self.top_k)
        if not _is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise _bad("min_p", self.min_p, "must be in [0, 1]")
        self.min_p = float(self.min_p)
        if self.seed is not None and (not _is_int(self.seed) or not INT64_MIN <= self.seed <= INT64_MAX):
            raise _bad("seed", self.seed, f"must be None or an int in [{INT64_MIN}, {INT64_MAX}] (64-bit)")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= INT64_MAX):
            raise _bad("max_tokens", self.max_tokens, f"must be None or an int in [1, {INT64_MAX}]")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= INT64_MAX:
            raise _bad("min_tokens", self.min_tokens, f"must be an int in [0, {INT64_MAX}]")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise _bad("min_tokens", self.min_tokens, f"must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and (not _is_int(self.logprobs)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise _bad("logprobs", self.logprobs, f"must be None or an int in [0, {MAX_LOGPROBS}]")
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs)
                                                 or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise _bad("prompt_logprobs", self.prompt_logprobs, f"must be None or an int in [0, {MAX_LOGPROBS}]")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_real(v) or not -2.0 <= v <= 2.0:
                raise _bad(name, v, "must be in [-2, 2]")
            setattr(self, name, float(v))
        rp = self.repetition_penalty
        if not _is_finite(rp) or rp <= 0:
            raise _bad("repetition_penalty", rp, "must be a finite number > 0")
        self.repetition_penalty = float(rp)

    def _check_dllm(self) -> None:
        """The diffusion options' types and ranges (whether they fit the model: check_diffusion)."""
        for name in ("dllm_block_length", "dllm_denoising_steps"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or not 1 <= v <= 4096):
                raise _bad(name, v, "must be None or an int in [1, 4096]")
        s = self.dllm_unmasking_strategy
        if s is not None and s not in UNMASKING_STRATEGIES:
            raise _bad("dllm_unmasking_strategy", s, f"must be one of {', '.join(UNMASKING_STRATEGIES)}")
        t = self.dllm_confidence_threshold
        if t is not None:
            if not _is_real(t) or not 0.0 < t <= 1.0:
                raise _bad("dllm_confidence_threshold", t, "must be in (0, 1]")
            self.dllm_confidence_threshold = float(t)
        if self.dllm_chunk is not None:
            try:
                self.dllm_chunk = str(parse_chunk(self.dllm_chunk))
            except ValueError:
                raise _bad("dllm_chunk", self.dllm_chunk,
                           f"must be auto, elastic, block or an integer in [1, {MAX_FIXED_CHUNK}]") from None

    def diffusion_options(self) -> list[str]:
        """The diffusion options this request sets (an autoregressive model refuses any)."""
        return [n for n in ("dllm_block_length", "dllm_unmasking_strategy", "dllm_denoising_steps",
                            "dllm_confidence_threshold", "dllm_chunk") if getattr(self, n) is not None]

    def _check_stops(self) -> None:
        stop = self.stop
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise _bad("stop", self.stop, "must be a non-empty string or a list of non-empty strings")
        self.stop = list(stop)
        ids = self.stop_token_ids
        if ids is None:
            ids = []
        if not isinstance(ids, (list, tuple)) or not all(_is_int(t) and 0 <= t <= INT32_MAX for t in ids):
            raise _bad("stop_token_ids", self.stop_token_ids, f"must be a list of token ids in [0, {INT32_MAX}]")
        self.stop_token_ids = [int(t) for t in ids]

    def _check_logit_bias(self) -> None:
        """Token ids in [0, 2^31), finite biases in [-100, 100], at most MAX_LOGIT_BIAS entries; {} becomes None."""
        lb = self.logit_bias
        if lb is None:
            return
        if not isinstance(lb, dict):
            raise _bad("logit_bias", lb, "must be None or a dict of token id -> bias")
        if len(lb) > MAX_LOGIT_BIAS:
            raise SamplingParamsError(f"logit_bias may have at most {MAX_LOGIT_BIAS} entries, got {len(lb)}")
        for t, b in lb.items():
            if not _is_int(t) or not 0 <= t <= INT32_MAX:
                raise _bad("logit_bias", t, f"keys must be token ids in [0, {INT32_MAX}]")
            if not _is_finite(b) or not -MAX_BIAS <= b <= MAX_BIAS:
                raise _bad("logit_bias", b, f"values must be numbers in [{-MAX_BIAS:g}, {MAX_BIAS:g}] (token {t})")
        self.logit_bias = {int(t): float(b) for t, b in lb.items()} or None

    @property
    def greedy(self) -> bool:
        """True when the request takes the argmax token (temperature 0 or top_k 1)."""
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def max_stop_len(self) -> int:
        """Length of the longest stop string (0 without any): how much text streaming holds back + 1."""
        return max((len(s) for s in self.stop), default=0)

    def clone(self) -> SamplingParams:
        """A deep copy, so per-request mutation never leaks into a shared template."""
        return copy.deepcopy(self)


def unsupported_diffusion_fields(params: SamplingParams) -> list[str]:
    """The set sampling fields block-diffusion decoding does not implement (empty: all supported)."""
    return [k for k, default in _NOT_FOR_DIFFUSION.items() if getattr(params, k) != default]


def check_diffusion(params: SamplingParams, block: int | None) -> None:
    """SamplingParamsError when a request's diffusion options do not fit the model: any on an autoregressive one
    (`block` None); a block length other than the engine's, steps that do not divide it, or a sampling field
    diffusion decoding does not implement. The engine and the server's coordinator both check with it."""
    if block is None:
        opts = params.diffusion_options()
        if opts:
            raise SamplingParamsError(f"{', '.join(opts)}: diffusion options, but this model is autoregressive")
        return
    bad = unsupported_diffusion_fields(params)
    if bad:
        raise SamplingParamsError(f"block-diffusion decoding does not support {', '.join(bad)}")
    if params.dllm_block_length is not None and params.dllm_block_length != block:
        raise SamplingParamsError(f"dllm_block_length {params.dllm_block_length} is not this engine's block length "
                                  f"{block} (one block length per engine: --dllm-block-length)")
    steps = params.dllm_denoising_steps
    if steps is not None and (steps > block or block % steps):
        raise SamplingParamsError(f"dllm_denoising_steps {steps} must divide the block length {block}")
