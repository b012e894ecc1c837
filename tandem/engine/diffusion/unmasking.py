"""One denoise step's decisions: sample every masked position, then choose which to commit (unmask).

Names follow LMDeploy's block-diffusion options: `dllm_block_length`, `dllm_unmasking_strategy`
(`low_confidence_dynamic`, `low_confidence_static`, `sequential`), `dllm_denoising_steps`,
`dllm_confidence_threshold`. Per step each masked position gets a token and a confidence, the probability of that
token under the distribution it was drawn from (greedy: the softmax of the raw logits); then

- `sequential` commits the first `quota` masked positions, left to right;
- `low_confidence_static` commits the `quota` most confident ones;
- `low_confidence_dynamic` commits every one whose confidence is above the threshold, and at least `quota` (the most
  confident ones when fewer pass; with the default quota of 1, the top-1 when nothing passes).

`quota` = dllm_block_length // dllm_denoising_steps (at least 1; default steps = the block length, so 1), never
more than the positions still masked. This is SDAR's generate (JetAstra/SDAR generate.py) and LMDeploy's
unmasking, with two differences written down: the dynamic rule is `>` threshold, as SDAR's (LMDeploy uses `>=`);
the quota is clamped to the masked positions left (SDAR's top-k over the whole block could otherwise pick
positions that are not masked, such as prompt tokens sharing the first block, and overwrite them).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from tandem.engine.sampling_params import UNMASKING_STRATEGIES



@dataclass(frozen=True)
class DllmConfig:
    """How a block-diffusion model decodes a block (LMDeploy's option names)."""

    dllm_block_length: int | None = None          # None: the model's config.json block_size
    dllm_unmasking_strategy: str = "low_confidence_dynamic"
    dllm_denoising_steps: int | None = None       # None: the block length (a quota of one token per step)
    dllm_confidence_threshold: float = 0.9

    def __post_init__(self) -> None:
        """Validate every option, naming it."""
        b, s, t = self.dllm_block_length, self.dllm_denoising_steps, self.dllm_confidence_threshold
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 1):
            raise ValueError(f"dllm_block_length must be a positive integer, got {b!r}")
        if self.dllm_unmasking_strategy not in UNMASKING_STRATEGIES:
            raise ValueError(f"dllm_unmasking_strategy must be one of {', '.join(UNMASKING_STRATEGIES)}, "
                             f"got {self.dllm_unmasking_strategy!r}")
        if s is not None and (isinstance(s, bool) or not isinstance(s, int) or s < 1 or (b is not None and s > b)):
            raise ValueError(f"dllm_denoising_steps must be an integer in [1, dllm_block_length], got {s!r}")
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0.0 <= float(t) <= 1.0:
            raise ValueError(f"dllm_confidence_threshold must be a number in [0, 1], got {t!r}")

    def block_length(self, model_block_size: int) -> int:
        """The decoding block length: dllm_block_length, else the model's."""
        return self.dllm_block_length or int(model_block_size)

    def quota(self, block_length: int) -> int:
        """Tokens a step commits at least (static, sequential: exactly): block length // denoising steps, >= 1."""
        steps = self.dllm_denoising_steps or block_length
        if steps > block_length:
            raise ValueError(f"dllm_denoising_steps {steps} exceeds the block length {block_length}")
        return max(1, block_length // steps)


ARGMAX_CHUNKS = (256, 128, 64)      # chunk widths first_argmax tries, widest first (one must divide the vocabulary)


def first_argmax(x: Tensor) -> Tensor:
    """x.argmax(-1) for x [n, V], the same indices (the first maximum of each row, NaN as the largest); on the CPU in
    two vectorised passes, each chunk's max, then the argmax within the first chunk holding the row's max (aten's CPU
    argmax reduces the vocabulary one element at a time: about 6x slower for a 32k vocabulary)."""
    n, V = x.shape
    c = next((c for c in ARGMAX_CHUNKS if V % c == 0 and V > c), 0)
    if n == 0 or not c or x.device.type != "cpu" or not x.is_contiguous():
        return x.argmax(dim=-1)
    chunks = x.view(n, V // c, c)
    first = chunks.amax(dim=-1).argmax(dim=-1)
    rows = torch.arange(n, device=x.device)
    return first * c + chunks[rows, first].argmax(dim=-1)


def sample_tokens(logits: Tensor, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                  generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """Tokens [n] and their confidences [n] for logits [n, V]: greedy at temperature 0, else a seeded draw.

    A draw divides by the temperature, keeps the top_k logits (0 or -1: all) and the smallest top_p nucleus, and
    samples from the softmax with torch.multinomial on `generator` (SDAR's sampler); its confidence is the drawn
    token's probability under that distribution. Greedy takes the argmax (ties to the lowest id) and the softmax
    probability of the raw logits.
    """
    logits = logits.float()
    if temperature == 0.0:
        tokens = first_argmax(logits)
        conf = torch.softmax(logits, dim=-1).gather(-1, tokens[:, None])[:, 0]
        return tokens, conf
    x = logits / float(temperature)
    V = x.shape[-1]
    if 0 < top_k < V:
        kth = torch.topk(x, top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        cum = torch.softmax(sorted_x, dim=-1).cumsum(dim=-1)
        drop = cum > top_p
        drop[:, 1:] = drop[:, :-1].clone()       # keep the token that crosses top_p
        drop[:, 0] = False
        x = x.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    probs = torch.softmax(x, dim=-1)
    tokens = torch.multinomial(probs, 1, generator=generator)[:, 0]
    return tokens, probs.gather(-1, tokens[:, None])[:, 0]


def select_commits(confidence: Tensor, strategy: str, quota: int, threshold: float) -> Tensor:
    """Which of the masked positions (confidence [n], in position order) this step commits: bool [n], >= 1 True."""
    n = confidence.shape[0]
    if n == 0:
        return torch.zeros(0, dtype=torch.bool)
    k = min(int(quota), n)
    chosen = torch.zeros(n, dtype=torch.bool, device=confidence.device)
    if strategy == "sequential":
        chosen[:k] = True
        return chosen
    if strategy == "low_confidence_dynamic":
        above = confidence > threshold
        if int(above.sum()) >= k:
            return above
    elif strategy != "low_confidence_static":
        raise ValueError(f"unknown unmasking strategy {strategy!r} (valid: {', '.join(UNMASKING_STRATEGIES)})")
    order = torch.sort(confidence, descending=True, stable=True).indices   # equal confidences: leftmost first
    chosen[order[:k]] = True
    return chosen
