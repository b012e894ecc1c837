"""The Optimus step planner of a block-diffusion worker: each step's window per decoding sequence, sized by the
ChunkSizer (tandem/policy/optimus) beside block-aligned prefill chunks; N_commit and T(c, b) learn from the results."""
from __future__ import annotations

from tandem.core.chunked_planner import ChunkedPlanner
from tandem.core.residency import WorkerHost
from tandem.core.types import PrefillTask, Seq, StepPlan, StepResult
from tandem.policy.optimus.chunk import ChunkMode, ChunkSizer, ChunkSpec, SeqWindow, request_chunk


class WindowPlanner(ChunkedPlanner):
    """Optimus windows: streaming chunked decoding (elastic, fixed chunk) or plain block diffusion, per round."""

    def __init__(self, chunker: ChunkSizer) -> None:
        self.chunker = chunker
        self.chunks: dict[str, ChunkSpec] = {}      # the chunk each session's current round decodes with
        self.default_chunk = request_chunk(chunker.spec)   # a round never told
        self.sat_out: dict[str, int] = {}           # steps a running sequence has sat out in a row
        self.seen: dict[tuple[int, int, int], list[int]] = {}   # this step's commits, as N_commit learns them

    def choose_chunk(self, sid: str, asked: ChunkSpec | None = None, reproducible: bool = False) -> ChunkSpec | None:
        """Decide the chunk session `sid`'s next round decodes with (`request_chunk`: the request's own, else the
        worker's; `auto` gives the whole block to a request that wants reproducible tokens, greedy or seeded) and
        keep it for that round's steps."""
        spec = self.chunks[sid] = request_chunk(self.chunker.spec, asked, reproducible)
        return spec

    def chunk_of(self, sid: str) -> ChunkSpec | None:
        return self.chunks.get(sid, self.default_chunk)

    def forget(self, sid: str) -> None:
        self.chunks.pop(sid, None)

    def whole(self, seq: Seq) -> bool:
        """Whether the sequence decodes by plain block diffusion (every step recomputes its whole block)."""
        return self.chunks.get(seq.session_id, self.default_chunk).mode is ChunkMode.BLOCK

    @staticmethod
    def masked_left(core: WorkerHost, seq: Seq) -> int:
        """Masked positions of a diffusion sequence's active block, at most its tokens still to decode: what a window
        may cover (the sizer prices it, N_commit learns by it)."""
        B = core.cfg.dllm_block
        return min(B - seq.num_tokens % B, seq.to_decode)

    # ---------------------------------------------------------------- steps
    def grow(self, core: WorkerHost, now: float) -> None:
        self.size_windows(core)
        kv = core.kv
        if any(kv.kv_target(seq) > seq.cap for seq in core.running):
            kv.grow(now)

    def decode(self, core: WorkerHost, plan: StepPlan) -> int:
        """Diffusion windows: bidirectional rows over the cached keys, those sitting this step out left out."""
        plan.decode = list(core.running)
        if self.sat_out:
            plan.decode = [seq for seq in plan.decode if seq.query_tokens]
        B = core.cfg.dllm_block
        shape = plan.shape
        for seq in plan.decode:
            q = seq.query_tokens                     # plain block diffusion recomputes the block from its start;
            # streaming reads every committed position's K/V but the ones it writes now
            start = (seq.num_tokens - seq.num_tokens % B if self.whole(seq)
                     else seq.num_tokens - seq.kv_pending - seq.kv_prompt)
            shape.add_window(start, q)
        return shape.num_decode

    def cut(self, core: WorkerHost, t: PrefillTask, budget: int) -> int:
        """Block-causal: a chunk ends on a block boundary (a query sees all of its block)."""
        return budget - (t.first + t.done + budget) % core.cfg.dllm_block

    def cost(self, core: WorkerHost, t: PrefillTask, n: int) -> int:
        """The prompt's last, partial block is computed with the windows (Seq.kv_prompt), not with its chunk."""
        return n - (t.first + t.work) % core.cfg.dllm_block if t.done + n == t.work else n

    def size_windows(self, core: WorkerHost) -> None:
        """This step's window per sequence. The chunk sizer picks each sequence's window within the
        token budget, less what waiting prefills keep of it (dllm_prefill_share of the budget at most: the diffusion
        engines Optimus builds on run prefills first, and windows that fill the budget would starve them); a window
        stays within the active block (blocks are aligned to absolute positions): min(c, masked positions left in
        the block) for a fixed chunk c, a size of its own for elastic, which it may commit, besides the K/V writes of
        the last commits and the prompt's leftover tokens it carries (outside c, taken out of the budget first);
        plain block diffusion (c = B) computes the whole block. When more prompts are ready than fit beside the smallest windows, the sizer is told the rows they fill:
        the windows then displace prompt rows, and it prices them so. When even windows of one position do not fit
        the budget (elastic; the carried rows fill it), or a fixed chunk's or the block's windows overflow it (the
        budget caps every step, as in vLLM; a fixed chunk leaves no share to waiting prefills), the sizer runs the
        first sequences that fit and the others sit the step out, those that sat out longest going first next time.
        Under elastic and auto each session decodes in the mode decided for its round (`choose_chunk`): a whole block
        or a fixed chunk rides in the elastic steps with its window pinned, priced with them."""
        cfg, chunker = core.cfg, self.chunker
        B = cfg.dllm_block
        budget = cfg.max_num_batched_tokens
        admitted = ready = 0                         # prompt rows admitted; of those, the ones this step runs beside
        for t in core.active:                        # the windows (sized only when the step mixes, or when no
            left = t.work - t.done                   # prompt is ready)
            admitted += left
            if t.kv_ready:
                ready += left
        waiting = admitted + sum(t.work for t in core.queue)
        claim = min(waiting, int(cfg.dllm_prefill_share * budget))   # what waiting prefills keep of the step
        elastic = chunker.elastic
        sat = self.sat_out                           # longest sat out first, else in running order
        order = sorted(core.running, key=lambda q: -sat.get(q.session_id, 0)) if sat else core.running
        lefts = [self.masked_left(core, seq) for seq in order]
        wholes = [self.whole(seq) for seq in order]
        seqs = []
        for left, whole, seq in zip(lefts, wholes, order):
            if not elastic:                          # one mode for all: the sizer's own (the block carries nothing)
                seqs.append(SeqWindow(left, seq.kv_pending, seq.kv_prompt, seq.num_tokens, seq.tried))
            elif whole:                              # a request's block beside elastic windows: pinned, with its
                # decoded positions and prompt tokens, recomputed every step, as extra rows
                seqs.append(SeqWindow(left, seq.kv_pending, B - left, seq.num_tokens, seq.tried, B))
            else:                                    # elastic, or a request's fixed chunk (pinned)
                spec = self.chunk_of(seq.session_id)
                pin = spec.size if spec is not None and spec.mode is ChunkMode.FIXED else 0
                seqs.append(SeqWindow(left, seq.kv_pending, seq.kv_prompt, seq.num_tokens, seq.tried, pin))
        carried = 0                                  # rows riding with the windows: K/V writes, prompts' tails
        if elastic or not chunker.recomputes_block:
            carried = sum(s.pending + s.extra for s in seqs)
        full = budget - carried                      # the prompt rows that fill the step, when more are ready than
        # fit beside the smallest windows
        windows = chunker.plan(seqs, room=full - claim if elastic else full,
                               prompts=full if 0 < full < ready + len(core.running) else 0).windows
        n = len(windows)
        if n < len(order) or sat or 0 in windows:
            self.sat_out = {seq.session_id: sat.get(seq.session_id, 0) + 1
                            for i, seq in enumerate(order) if i >= n or not windows[i]}
        for i, (left, whole, seq) in enumerate(zip(lefts, wholes, order)):
            pending = seq.kv_pending
            if i >= n or not windows[i]:             # sits this step out (the budget holds the others)
                seq.commit_cap = seq.query_tokens = 0
            elif whole:                              # the block, plus a completed block's first write
                seq.commit_cap = left
                seq.query_tokens = B + pending
            else:                                    # streaming: its window, besides the writes and the tail
                m = windows[i]
                seq.commit_cap = m
                seq.query_tokens = m + pending + seq.kv_prompt

    # ---------------------------------------------------------------- a round's life
    def started(self, core: WorkerHost, seq: Seq, task: PrefillTask) -> None:
        """A prefill writes whole blocks: streaming computes the prompt's leftover tokens with every window of their
        block, outside its chunk; after a recompute the active block's decoded positions are written by the first
        window, outside it too."""
        left = seq.num_tokens % core.cfg.dllm_block if not self.whole(seq) else 0
        tail = seq.kv_prompt if left else 0
        seq.kv_pending, seq.kv_prompt = (left - tail, tail) if task.recompute else (0, left)

    def commit(self, core: WorkerHost, plan: StepPlan, result: StepResult, now: float) -> None:
        """Commit the windows' tokens; the sizer times steps of windows alone and learns N_commit from the commits."""
        chunker = self.chunker
        chunker.observe_step(None if plan.prefill else result.elapsed_s)
        self.seen = {}                               # (window, masked left in its block, tried) -> commits
        core.commit(plan, result.committed, result.finished, now, self.committed)
        for (window, left, tried), got in self.seen.items():
            chunker.observe(window, got, left, tried)

    def committed(self, core: WorkerHost, seq: Seq, asked: int, c: int) -> None:
        """One sequence's commit (`asked`, `c` once cut to its round's end), before it is counted: what the next
        window writes (block_state.py)."""
        self.chunker.count(asked)
        if seq.to_decode >= seq.commit_cap > 0:      # not cut short by max_tokens: N_commit's evidence
            self.seen.setdefault((seq.commit_cap, self.masked_left(core, seq), seq.tried), []).append(asked)
        B = core.cfg.dllm_block
        n = seq.num_tokens + c                       # its tokens once counted
        if self.whole(seq):
            seq.kv_pending = B if c > 0 and n % B == 0 else 0
        else:
            seq.kv_pending = c                       # every window writes the last commits' K/V
            if n % B == 0:                           # the prompt's tail rides with every window of its block
                seq.kv_prompt = 0
        if n % B == 0:                               # a new block: nothing of it tried yet
            seq.tried = 0
        elif seq.commit_cap:                         # the window covered the first commit_cap masked positions
            seq.tried = max(seq.tried, seq.commit_cap) - c

    def finished(self, core: WorkerHost, seq: Seq) -> None:
        """The last block's K/V are not (all) written, nor final: the next round recomputes it with its prompt
        (SDAR's leftover tokens)."""
        B = core.cfg.dllm_block
        seq.num_tokens = (seq.num_tokens - 1) // B * B
        seq.kv_pending = seq.kv_prompt = 0


__all__ = ["WindowPlanner"]
