"""One sequence's block-diffusion decoding state, and the window a step computes (plain block diffusion or Optimus's
streaming chunks); the decoding loops (generate.py) and the engine (llm_engine.py) share it.

Positions are absolute. Blocks are aligned to them: the prompt's whole blocks are the prefix, its leftover tokens
start the first block as fixed tokens, every other position of the active block starts as the mask token.

A step's window, by mode:

- **block** (BD-B, `reuse=False`): the whole active block is recomputed every step; nothing of it is cached until it
  is complete; a completed block's K/V are written by the next step's forward (its positions as leading queries).
- **streaming chunks** (Optimus §4, `reuse=True`): each step computes the first c undecoded (masked) positions of
  the active block; the masked suffix past them is not computed. A decoded position's K/V are written once, by the
  step after the one that committed it (the token it was committed as is then the input; a finished block's last
  ones by the next block's first step), and read from the cache by every later step of the block: those writes
  ride with the window, outside c. The prompt's leftover tokens (its last, partial block) are not decoded positions:
  they ride with every window of their block, outside c, and their K/V are rewritten each time, as a block step
  recomputes them (written once, by the first window, they would hold a picture of the block before any commit;
  docs/diffusion.md measures what that costs).

c comes from the scheduler (core/worker.py sizes the same windows: Seq.commit_cap masked positions, kv_pending writes,
kv_prompt leftover tokens), so a step never commits more than the core planned. With c >= the block length, a
streaming step computes the same positions as a block step, minus the ones whose K/V it reuses.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import Tensor

from tandem.engine.diffusion.unmasking import DllmConfig, sample_tokens, select_commits
from tandem.engine.models.sdar import BlockDiffusionMetadata
from tandem.engine.sampling_params import SamplingParams


@dataclass
class DiffusionOutput:
    """One prompt's decoded tokens and how they were committed."""

    token_ids: list[int]                  # generated tokens (the stopping EOS included), at most max_tokens
    finish_reason: str                    # "stop" (EOS or a stop token id) or "length" (max_tokens)
    commits_per_step: list[int] = field(default_factory=list)   # tokens each denoise step committed
    masked_per_step: list[int] = field(default_factory=list)    # masked positions each step sampled (its window's)
    num_blocks: int = 0                   # blocks decoded

    @property
    def num_steps(self) -> int:
        """Denoise steps (model forwards over the active block) this prompt took."""
        return len(self.commits_per_step)

    @property
    def tokens_per_step(self) -> float:
        """Mean tokens committed per denoise step."""
        return sum(self.commits_per_step) / max(1, len(self.commits_per_step))


@dataclass
class Window:
    """What one step computes for one sequence: its query positions and tokens, which of them have their K/V
    written, which positions past `ctx` it reads from the cache, and which query rows are sampled."""

    positions: list[int]
    tokens: list[int]
    writes: list[int]                     # positions (among `positions`) whose K/V this step writes
    cached: list[int]                     # positions >= ctx read from the cache (the active block's decoded ones)
    ctx: int                              # positions 0..ctx-1 read from the cache (whole blocks)
    candidates: list[int]                 # offsets in the active block of the masked positions sampled
    rows: list[int]                       # their indices in `positions`
    streaming: bool = False               # streaming chunks (writes position by position), else the whole block


class BlockState:
    """One prompt's decoding state: the committed prefix, the active block, its cache state and its stop rules."""

    def __init__(self, prompt: Sequence[int], params: SamplingParams, cfg: DllmConfig, block: int, mask_id: int,
                 eos: frozenset[int], max_len: int, device: torch.device, n_cached: int = 0) -> None:
        """The first block: the prompt's leftover tokens, then masks; the prompt's whole blocks are the prefix, of
        which the first `n_cached` positions' K/V are in the cache already (an engine's prefill wrote them)."""
        P = len(prompt)
        if P < 1:
            raise ValueError("an empty prompt")
        self.params, self.B, self.mask_id = params, block, mask_id
        self.quota = cfg.quota(block)
        self.strategy, self.threshold = cfg.dllm_unmasking_strategy, float(cfg.dllm_confidence_threshold)
        self.eos = frozenset() if params.ignore_eos else eos | frozenset(params.stop_token_ids or ())
        room = max_len - P
        if room < 1:
            raise ValueError(f"a prompt of {P} tokens leaves no room under the model's {max_len} positions")
        self.max_tokens = room if params.max_tokens is None else min(int(params.max_tokens), room)
        self.P, self.limit = P, P + self.max_tokens
        start = P // block * block
        if not 0 <= n_cached <= start or n_cached % block:
            raise ValueError(f"n_cached {n_cached} must be whole blocks of the prompt's prefix (<= {start})")
        self.prefix: list[int] = list(prompt[:start])        # positions < the active block's start
        self.block: list[int] = list(prompt[start:]) + [mask_id] * (block - (P - start))
        # which block positions are still to decode (not token equality: a prompt may hold the mask token)
        self.undecoded: list[bool] = [False] * (P - start) + [True] * (block - (P - start))
        self.generator = None
        if params.seed is not None and params.temperature != 0.0:
            self.generator = torch.Generator(device=device).manual_seed(int(params.seed))
        self.out = DiffusionOutput([], "")
        self.n_cached = n_cached                              # positions 0..n_cached-1 have their K/V written
        self.written: set[int] = set()                        # positions >= n_cached with their K/V written
        self.emitted = 0                                      # generated tokens handed out by take_committed()

    @property
    def start(self) -> int:
        """The active block's first position."""
        return len(self.prefix)

    @property
    def done(self) -> bool:
        """True once the output is final."""
        return bool(self.out.finish_reason)

    def candidates(self) -> list[int]:
        """Offsets in the block of the masked positions still to decode (before the max_tokens limit)."""
        s = self.start
        return [j for j, u in enumerate(self.undecoded) if u and s + j < self.limit]

    def to_write(self) -> list[int]:
        """Streaming: decoded positions whose K/V are not written yet (a finished block's first), in order."""
        s, written = self.start, self.written
        out = [p for p in range(self.n_cached, s) if p not in written]
        out += [s + j for j, u in enumerate(self.undecoded) if not u and s + j not in written]
        return out

    def canvas(self) -> list[int]:
        """The tokens a full-length step computes: the prefix and the active block (block-causal: nothing after it
        exists yet; llada_generate.CanvasState adds the masked canvas after it)."""
        return self.prefix + self.block

    def token_at(self, p: int) -> int:
        """The token at position p (prefix or active block)."""
        s = self.start
        return self.prefix[p] if p < s else self.block[p - s]

    def window(self, c: int | None = None, reuse: bool = False) -> Window:
        """This step's window (module docstring): the whole block, or (streaming) the decoded positions still to
        write and the prompt's leftover tokens, then the first c masked positions of the block."""
        s, B = self.start, self.B
        cand = self.candidates()
        if not reuse:
            positions = list(range(self.n_cached, s + B))
            writes = list(range(self.n_cached, s))
            tokens = self.prefix[self.n_cached:] + self.block
            rows = [s - self.n_cached + j for j in cand]
            return Window(positions, tokens, writes, [], self.n_cached, cand, rows, False)
        if isinstance(c, bool) or not isinstance(c, int) or c < 1:
            raise ValueError(f"a streaming window needs a chunk c >= 1, got {c!r}")
        writes = self.to_write()
        cand = cand[:c]
        positions = writes + [s + j for j in cand]
        tokens = [self.token_at(p) for p in writes] + [self.mask_id] * len(cand)
        cached = sorted(self.written)
        rows = list(range(len(writes), len(positions)))
        return Window(positions, tokens, writes, cached, self.n_cached, cand, rows, True)

    def apply(self, win: Window, logits: Tensor) -> int:
        """The step ran: its writes are in the cache; sample its candidates (logits [len(rows), V], changed in place)
        and commit by the strategy. Returns the tokens committed."""
        if win.writes:
            if win.streaming:
                self.written.update(win.writes)              # streaming: position by position
                done = self.n_cached
                while done < self.start and all(p in self.written for p in range(done, done + self.B)):
                    self.written.difference_update(range(done, done + self.B))
                    done += self.B
                self.n_cached = done
            else:
                self.n_cached = self.start                    # block mode: the completed blocks, whole
        if not win.candidates:
            self.out.commits_per_step.append(0)
            self.out.masked_per_step.append(0)
            n = 0
        else:
            n = self.step(logits, win.candidates)
        if win.streaming and self.start < self.P:            # the prompt's tail: rewritten by every window of its
            self.written.difference_update(range(self.start, self.P))   # block, as a block step recomputes it
        return n

    def step(self, logits: Tensor, cand: list[int]) -> int:
        """Sample the candidates' logits [n, V] (changed in place), commit by the strategy; finish a full block.

        The mask token is never sampled: committing it would leave the position masked forever.
        """
        p = self.params
        logits[:, self.mask_id] = float("-inf")
        tokens, conf = sample_tokens(logits, p.temperature, p.top_k, p.top_p, self.generator)
        chosen = select_commits(conf, self.strategy, self.quota, self.threshold).tolist()
        toks = tokens.tolist()
        for j, c, t in zip(cand, chosen, toks):
            if c:
                self.block[j] = t
                self.undecoded[j] = False
        n = sum(chosen)
        self.out.commits_per_step.append(n)
        self.out.masked_per_step.append(len(cand))
        if len(self.candidates()) == 0:
            self._finish_block()
        return n

    def committed(self) -> list[int]:
        """The generated tokens of the longest committed prefix (what a stream may show), up to max_tokens."""
        s = self.start
        out = self.prefix[self.P:] if self.P < s else []
        for j in range(max(0, self.P - s), self.B):
            if self.undecoded[j] or s + j >= self.limit:
                break
            out.append(self.block[j])
        return out

    def take_committed(self) -> list[int]:
        """The committed prefix's tokens not handed out before (a stream's next chunk)."""
        toks = self.committed() if not self.done else self.out.token_ids
        new = toks[self.emitted:]
        self.emitted = len(toks)
        return new

    def _finish_block(self) -> None:
        """Append the block's generated tokens; stop at the first EOS or at max_tokens, else start the next block."""
        s = self.start
        self.out.num_blocks += 1
        gen = [t for j, t in enumerate(self.block) if self.P <= s + j < self.limit]
        for t in gen:
            self.out.token_ids.append(t)
            if t in self.eos:
                self.out.finish_reason = "stop"
                return
        if len(self.out.token_ids) >= self.max_tokens:
            self.out.finish_reason = "length"
            return
        self.prefix.extend(self.block)
        self.block = [self.mask_id] * self.B
        self.undecoded = [True] * self.B

    def prefilled(self) -> None:
        """A prefill wrote the sequence's whole blocks before the active one (the prompt's, or after a preemption
        all of them again): nothing of the active block is cached; its leftover prompt tokens and decoded positions
        are written by the next streaming windows, recomputed with the block in block mode."""
        self.n_cached = self.start
        self.written.clear()


def build_step(windows: Sequence[Window], block_tables: Sequence[Sequence[int]], kv_block_size: int, block: int,
               device: torch.device) -> tuple[Tensor, BlockDiffusionMetadata, Tensor]:
    """One forward's inputs for these windows (a prefill chunk is a window that writes all of its positions and
    samples nothing): token ids [T], the block-diffusion metadata, and the rows [R] of every window's candidates."""
    ids: list[int] = []
    rows: list[int] = []
    for w in windows:
        rows.extend(len(ids) + r for r in w.rows)
        ids.extend(w.tokens)
    meta = BlockDiffusionMetadata.build([w.positions for w in windows], [w.ctx for w in windows],
                                        [0] * len(windows), block_tables, kv_block_size, block, device,
                                        writes=[w.writes for w in windows], cached=[w.cached for w in windows])
    return (torch.tensor(ids, dtype=torch.long, device=device), meta,
            torch.tensor(rows, dtype=torch.long, device=device))


def prefill_window(start: int, tokens: Sequence[int]) -> Window:
    """A prefill chunk of whole blocks as a window: positions start.. written, nothing sampled."""
    pos = list(range(start, start + len(tokens)))
    return Window(pos, list(tokens), pos, [], start, [], [], True)
