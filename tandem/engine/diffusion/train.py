"""Train the tiny SDAR checkpoint: the block-diffusion (SDAR / BD3-LM) objective on the synthetic task corpus.

Per sequence (prompt + answer + EOS, padded with EOS to whole blocks of B) and per block k, a noise level
t_k ~ U(eps, 1) masks each answer token of the block (prompt tokens never) with probability t_k. The noisy sequence
and the clean one go through the model side by side, both at positions 0..L-1, under the block-diffusion mask:
noisy block k sees itself bidirectionally and the clean blocks before k; clean blocks are block-causal among
themselves (they stand for the KV cache of committed blocks at inference; the last clean block, which no noisy block
reads, is left out). The loss is the cross-entropy of the masked noisy positions, each weighted by 1/t of its
block, summed and divided by the number of answer positions (SDAR's normalisation). No logit shift: the output at
a position predicts that position's token.

The vocabulary has SDAR_VOCAB_SIZE ids but the tokenizer produces only its first U (a few hundred); the embedding
rows past U are held at zero (tied embeddings, so their logits are exactly 0 at every position), which keeps the
full-vocabulary softmax exact at the cost of the used rows: log-sum-exp over V ids = logaddexp(lse(used logits),
log(V - U)). The decoding loops compute all V logits as usual.

`TrainConfig.block_sizes` (`tandem tiny-model --train-block-sizes`; default 1, 2, 4, 8, 16, 32) draws each step's
block size from a set of divisors of the model's block size (its config keeps that one): the noisy blocks are then
sometimes as short as a streaming window, with nothing after them, as Optimus's chunks run at inference. Trained on
blocks of 32 alone, the tiny model lost 0.9 to 7.4 points of held-out accuracy at chunk 4 (docs/diffusion.md).

SDAR itself converts a trained AR model (next-token prediction, then this objective without logit shift or mask
annealing); `TrainConfig.ar_steps` runs that recipe: next-token prediction over the whole sequence under a causal
mask for the first ar_steps steps, then `steps` of the block-diffusion objective (the committed checkpoint has none:
docs/diffusion.md measures both).

The engine's SDARForCausalLM holds the weights (its inference forward uses in-place and out= ops that autograd does
not take), so `dense_hidden` is a differentiable forward over the same parameters; a test checks it equals the
engine's forward.
"""
from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from tandem.engine.diffusion.tasks import TASKS, draw
from tandem.engine.models import ModelConfig, SDARForCausalLM
from tandem.engine.tiny_model import MASK_TOKEN, SDAR_BLOCK_SIZE, arch_tokenizer, model_config, write_checkpoint
from tandem.engine.tiny_options import TRAIN_AR_STEPS, TRAIN_BLOCK_SIZES, TRAIN_DTYPE, TRAIN_STEPS, TRAIN_THREADS

SIZE_STREAM = 12345              # the seed offset of the stream that draws each step's block size (block_sizes)
DEFAULT_MIX = {"copy": 2.0, "reverse": 2.0, "sort": 1.0, "count": 1.0, "add": 1.0, "words": 0.5}


@dataclass
class TrainConfig:
    """Hyperparameters of `train`; the defaults made the committed checkpoint (docs/diffusion.md)."""

    seed: int = 0
    steps: int = TRAIN_STEPS
    batch_size: int = 32
    lr: float = 3e-3
    min_lr_ratio: float = 0.1          # cosine decay to lr * this
    warmup: int = 50
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    eps: float = 1e-3                  # t ~ U(eps, 1)
    init_std: float = 0.1              # linear weights (residual outputs: / sqrt(2 * layers))
    embed_std: float = 0.5             # the (tied) embedding rows (at 0.02, as HF's default, nothing was learnt)
    dtype: str = TRAIN_DTYPE           # the saved weights' dtype
    threads: int = TRAIN_THREADS       # torch threads while training: the weights depend on the count (float
                                       # reductions split differently), not on the machine's cores
    mix: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_MIX))
    warm_steps: int = 600              # the first steps draw only the warm_tasks (a curriculum: without it, whether
                                       # copy and reverse were learnt in the budget depended on the seed)
    warm_tasks: tuple[str, ...] = ("copy", "reverse")
    ar_steps: int = TRAIN_AR_STEPS     # SDAR's recipe: next-token prediction (causal, shifted) for these steps first,
                                       # then `steps` of the block-diffusion objective convert the AR model
    block_sizes: tuple[int, ...] = TRAIN_BLOCK_SIZES      # the noisy blocks' size, drawn per step from these (each
                                       # dividing the model's block_size, which its config keeps); (): block_size alone

    def __post_init__(self) -> None:
        self.block_sizes = tuple(self.block_sizes)
        bad = [b for b in self.block_sizes if isinstance(b, bool) or not isinstance(b, int) or b < 1
               or SDAR_BLOCK_SIZE % b]
        if bad:
            raise ValueError(f"training block sizes must divide the model's block size {SDAR_BLOCK_SIZE}, "
                             f"got {bad[0]!r}")


@dataclass
class Batch:
    """One training batch: inputs of the noisy + clean sequence, and what the loss reads."""

    ids: Tensor          # int64 [N, S]: noisy (L) then clean (L - B) tokens
    positions: Tensor    # int64 [S]
    mask: Tensor         # bool [S, S] block-diffusion attention mask
    rows: Tensor         # int64 [M] flat (n * S + s) indices of the masked noisy positions
    targets: Tensor      # int64 [M] their clean tokens
    weights: Tensor      # float32 [M] 1 / t of their blocks
    num_answer: int      # answer positions (maskable) in the batch: the loss's denominator


def block_diffusion_mask(L: int, B: int, with_last_clean: bool = False) -> Tensor:
    """bool [S, S] mask of noisy [0, L) then clean [L, L + C) tokens (C = L - B, or L with the last clean block)."""
    C = L if with_last_clean else L - B
    blk = torch.cat([torch.arange(L) // B, torch.arange(C) // B])
    noisy = torch.cat([torch.ones(L, dtype=torch.bool), torch.zeros(C, dtype=torch.bool)])
    bq, bk = blk[:, None], blk[None, :]
    nq, nk = noisy[:, None], noisy[None, :]
    same_noisy = nq & nk & (bq == bk)                  # a noisy block sees itself
    noisy_to_clean = nq & ~nk & (bk < bq)              # ... and the clean blocks before it
    clean = ~nq & ~nk & (bk <= bq)                     # clean blocks: block-causal
    return same_noisy | noisy_to_clean | clean


def make_batch(examples: list[tuple[list[int], list[int]]], B: int, mask_id: int, eos_id: int, eps: float,
               g: torch.Generator) -> Batch:
    """Noise a batch of (prompt ids, answer ids) under per-block levels t ~ U(eps, 1) drawn from `g`."""
    seqs, starts = [], []
    for prompt, answer in examples:
        s = prompt + answer + [eos_id]
        s += [eos_id] * (-len(s) % B)
        seqs.append(s)
        starts.append(len(prompt))
    L = max(len(s) for s in seqs)
    N = len(seqs)
    clean = torch.full((N, L), eos_id, dtype=torch.long)
    answer = torch.zeros(N, L, dtype=torch.bool)
    for i, (s, p) in enumerate(zip(seqs, starts)):
        clean[i, :len(s)] = torch.tensor(s)
        answer[i, p:len(s)] = True                     # batch padding past len(s): no loss
    nb = L // B
    t = eps + (1 - eps) * torch.rand(N, nb, generator=g)
    t_pos = t.repeat_interleave(B, dim=1)
    masked = answer & (torch.rand(N, L, generator=g) < t_pos)
    noisy = torch.where(masked, torch.full_like(clean, mask_id), clean)
    ids = torch.cat([noisy, clean[:, :L - B]], dim=1)
    S = ids.shape[1]
    n_idx, p_idx = masked.nonzero(as_tuple=True)
    return Batch(ids=ids, positions=torch.cat([torch.arange(L), torch.arange(L - B)]),
                 mask=block_diffusion_mask(L, B), rows=n_idx * S + p_idx, targets=clean[n_idx, p_idx],
                 weights=1.0 / t_pos[n_idx, p_idx], num_answer=int(answer.sum()))


def _rms(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """RMSNorm as the engine's (float32 statistics, cast back before the weight), differentiable."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE with half-width cos/sin, as layers.apply_rotary but without out= (differentiable)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def dense_hidden(model: SDARForCausalLM, embed: Tensor, ids: Tensor, positions: Tensor, mask: Tensor) -> Tensor:
    """Differentiable forward of the engine model's weights: ids [N, S] at positions [S] under mask [S, S] -> [N, S, H].

    `embed` is the input embedding table (the trainable used rows while training). Same ops as the engine's
    inference forward (tandem.engine.models.layers), without in-place or out= ops.
    """
    m, cfg = model.model, model.config
    eps = cfg.rms_norm_eps
    N, S = ids.shape
    x = F.embedding(ids, embed)
    cos, sin = m.rotary_emb.cos_sin(positions, x.dtype)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    for layer in m.layers:
        a = layer.self_attn
        h = _rms(x, layer.input_layernorm.weight, eps)
        qkv = F.linear(h, a.qkv_proj.weight, a.qkv_proj.bias)
        q = qkv[..., :a.q_size].view(N, S, a.num_heads, a.head_dim)
        k = qkv[..., a.q_size:a.q_size + a.kv_size].view(N, S, a.num_kv_heads, a.head_dim)
        v = qkv[..., a.q_size + a.kv_size:].view(N, S, a.num_kv_heads, a.head_dim)
        q, k = _rope(_rms(q, a.q_norm.weight, eps), cos, sin), _rope(_rms(k, a.k_norm.weight, eps), cos, sin)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                           scale=a.scale, enable_gqa=a.num_heads != a.num_kv_heads)
        x = x + F.linear(o.transpose(1, 2).reshape(N, S, -1), a.o_proj.weight, a.o_proj.bias)
        h = _rms(x, layer.post_attention_layernorm.weight, eps)
        gu = F.linear(h, layer.mlp.gate_up_proj.weight, layer.mlp.gate_up_proj.bias)
        n = layer.mlp.intermediate
        x = x + F.linear(F.silu(gu[..., :n]) * gu[..., n:], layer.mlp.down_proj.weight, layer.mlp.down_proj.bias)
    return _rms(x, m.norm.weight, eps)


def diffusion_loss_sum(model: SDARForCausalLM, embed: Tensor, batch: Batch, vocab_size: int) -> Tensor:
    """The summed 1/t-weighted cross-entropy of the masked positions over the full vocabulary (unused rows at 0)."""
    hidden = dense_hidden(model, embed, batch.ids, batch.positions, batch.mask)
    h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, batch.rows)
    logits = (h @ embed.t()).float()                                   # [M, U]
    unused = vocab_size - embed.shape[0]
    lse = torch.logsumexp(logits, dim=-1)
    if unused:
        lse = torch.logaddexp(lse, torch.full_like(lse, math.log(unused)))
    ce = lse - logits.gather(-1, batch.targets[:, None])[:, 0]
    return (ce * batch.weights).sum()


def make_batches(examples: list[tuple[list[int], list[int]]], B: int, mask_id: int, eos_id: int, eps: float,
                 g: torch.Generator) -> list[Batch]:
    """One Batch per length in blocks (no padding across lengths: a one-block sequence needs no clean copy)."""
    groups: dict[int, list[tuple[list[int], list[int]]]] = {}
    for prompt, answer in examples:
        groups.setdefault(-(-(len(prompt) + len(answer) + 1) // B), []).append((prompt, answer))
    return [make_batch(groups[n], B, mask_id, eos_id, eps, g) for n in sorted(groups)]


def ntp_batch(examples: list[tuple[list[int], list[int]]], eos_id: int) -> Batch:
    """Next-token prediction over whole sequences (prompt + answer + EOS, padded with EOS): causal attention, each
    position's output predicts the next token (the AR base model SDAR converts)."""
    seqs = [prompt + answer + [eos_id] for prompt, answer in examples]
    L, N = max(len(s) for s in seqs), len(seqs)
    ids = torch.full((N, L), eos_id, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
    n_idx = torch.cat([torch.full((len(s) - 1,), i, dtype=torch.long) for i, s in enumerate(seqs)])
    p_idx = torch.cat([torch.arange(len(s) - 1) for s in seqs])
    return Batch(ids=ids, positions=torch.arange(L), mask=torch.ones(L, L, dtype=torch.bool).tril(),
                 rows=n_idx * L + p_idx, targets=ids[n_idx, p_idx + 1], weights=torch.ones(len(n_idx)),
                 num_answer=len(n_idx))


def diffusion_loss(model: SDARForCausalLM, embed: Tensor, batches: list[Batch], vocab_size: int) -> Tensor:
    """The objective of a step: 1/t-weighted masked cross-entropy summed over its batches / answer positions."""
    total = sum(diffusion_loss_sum(model, embed, b, vocab_size) for b in batches)
    return total / max(1, sum(b.num_answer for b in batches))


def init_model(seed: int, std: float = 0.1, embed_std: float = 0.5) -> tuple[SDARForCausalLM, Tensor, dict]:
    """A seeded random tiny SDAR model (float32) and its trainable used embedding rows [U, H]; the config dict."""
    config = model_config("sdar", "1m", "float32")
    mc = ModelConfig.from_dict(config)
    model = SDARForCausalLM(mc)
    g = torch.Generator().manual_seed(seed)
    scaled = std / math.sqrt(2 * mc.num_hidden_layers)         # residual-branch outputs (GPT-2's scaling)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("bias") or "embed_tokens" in name:
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (scaled if name.endswith(("o_proj.weight",
                                                                                      "down_proj.weight")) else std))
    used = arch_tokenizer("sdar").get_vocab_size(with_added_tokens=True)
    embed = (torch.randn(used, mc.hidden_size, generator=g) * embed_std).requires_grad_(True)
    return model, embed, config


def _lr(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to lr * min_lr_ratio over all the steps (AR, then diffusion)."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = (step - cfg.warmup) / max(1, cfg.ar_steps + cfg.steps - cfg.warmup)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


@dataclass
class TrainResult:
    """A trained model (float32, inference mode), its config dict, and the loss curve."""

    model: SDARForCausalLM
    config: dict
    losses: list[float]
    seconds: float


def train(cfg: TrainConfig, progress: bool = True,
          on_step: Callable[[int, float], None] | None = None) -> TrainResult:
    """Train a tiny SDAR model on the task corpus: cfg.ar_steps of next-token prediction, then cfg.steps of the
    block-diffusion objective (seeded: the same weights on every run)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        return _train(cfg, progress, on_step)
    finally:
        torch.set_num_threads(threads)


def _train(cfg: TrainConfig, progress: bool, on_step: Callable[[int, float], None] | None) -> TrainResult:
    """The training loop of `train`, under the thread count it set."""
    torch.manual_seed(cfg.seed)
    model, embed, config = init_model(cfg.seed, cfg.init_std, cfg.embed_std)
    tok = arch_tokenizer("sdar")
    mask_id, eos_id = config["mask_token_id"], config["eos_token_id"]
    B, V = config["block_size"], config["vocab_size"]
    params = [p for n, p in model.named_parameters() if "embed_tokens" not in n]
    for p in params:
        p.requires_grad_(True)
    model.model.embed_tokens.weight.requires_grad_(False)
    decay = [p for p in params if p.dim() >= 2] + [embed]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.98))
    rng = random.Random(cfg.seed)
    g = torch.Generator().manual_seed(cfg.seed + 1)
    sizes = cfg.block_sizes or (B,)
    size_rng = random.Random(SIZE_STREAM + cfg.seed)   # its own stream: the other draws do not depend on the sizes
    tasks = [t for t in TASKS if cfg.mix.get(t, 0) > 0]
    weights = [cfg.mix[t] for t in tasks]
    cache: dict[str, list[int]] = {}

    def enc(text: str) -> list[int]:
        """Token ids of a prompt or answer, cached (prompts repeat)."""
        ids = cache.get(text)
        if ids is None:
            ids = cache[text] = tok.encode(text).ids
        return ids

    losses: list[float] = []
    t0 = time.perf_counter()
    bar = None
    if progress:
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
        bar = Progress(TextColumn("training tiny SDAR"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                       TextColumn("loss {task.fields[loss]}"), TimeElapsedColumn(), TimeRemainingColumn())
        bar.start()
        task_id = bar.add_task("train", total=cfg.ar_steps + cfg.steps, loss="-")
    model.train()
    try:
        for step in range(cfg.ar_steps + cfg.steps):
            pool, w = (list(cfg.warm_tasks), None) if step < cfg.warm_steps else (tasks, weights)
            exs = [draw(rng.choices(pool, w)[0], rng, heldout=False) for _ in range(cfg.batch_size)]
            pairs = [(enc(e.prompt), enc(e.answer)) for e in exs]
            batches = ([ntp_batch(pairs, eos_id)] if step < cfg.ar_steps
                       else make_batches(pairs, size_rng.choice(sizes), mask_id, eos_id, cfg.eps, g))
            for group in opt.param_groups:
                group["lr"] = _lr(step, cfg)
            loss = diffusion_loss(model, embed, batches, V)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params + [embed], cfg.grad_clip)
            opt.step()
            losses.append(loss.item())
            if on_step is not None:
                on_step(step, losses[-1])
            if bar is not None:
                recent = losses[-20:]
                bar.update(task_id, advance=1, loss=f"{sum(recent) / len(recent):.3f}")
    finally:
        if bar is not None:
            bar.stop()
    model.eval()
    model.requires_grad_(False)
    with torch.no_grad():
        model.model.embed_tokens.weight.zero_()
        model.model.embed_tokens.weight[:embed.shape[0]] = embed.detach()
    return TrainResult(model, config, losses, time.perf_counter() - t0)


def save_trained(result: TrainResult, out_dir: str | Path, cfg: TrainConfig, command: str | None = None) -> Path:
    """Write the trained model as an HF checkpoint (weights in cfg.dtype) plus training.json (how it was made)."""
    from tandem.engine.loader import DTYPES, checkpoint_layout

    dtype = DTYPES[cfg.dtype]
    params = dict(result.model.named_parameters())
    tensors = {name: params[p][off:off + shape[0]].detach().to(dtype).contiguous()
               for name, (p, off, shape) in checkpoint_layout(result.model).items()}
    config = dict(result.config, torch_dtype=cfg.dtype)
    out = write_checkpoint(out_dir, config, tensors)
    info = {"command": command, "train_config": asdict(cfg), "seconds": round(result.seconds, 1),
            "torch": torch.__version__, "mask_token": MASK_TOKEN,
            "final_loss_mean_last_50": round(sum(result.losses[-50:]) / max(1, len(result.losses[-50:])), 4)}
    (out / "training.json").write_text(json.dumps(info, indent=2) + "\n")
    return out
