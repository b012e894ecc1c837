"""The torch executor: owns the model weights and the paged KV tensors, runs one planned step, samples."""
from __future__ import annotations

from itertools import accumulate

import numpy as np
import torch

from tandem.engine.attention import allocate_kv_cache, kv_bytes_per_block, native
from tandem.engine.attention.metadata import AttnMetadata
from tandem.engine.config import EngineConfig, kv_pool_blocks
from tandem.engine.cuda_graphs import DecodeGraphs, capture_sizes, graphs_apply
from tandem.engine.loader import load_model
from tandem.engine.model_input import ModelInput
from tandem.engine.prefill_graphs import PrefillGraphs, graph_buckets, graph_max_len, prefill_graphs_apply
from tandem.engine.sampler import Sampler, SampleOutput
from tandem.policy.task import COLOCATED, PREFILL

PROMPT_LOGPROBS_ELEMS = 1 << 22     # logits computed at once for prompt logprobs (rows x vocab; 16 MiB of float32)


class ModelRunner:
    """Loads a checkpoint, sizes and allocates the KV pool, and executes ModelInputs."""

    def __init__(self, cfg: EngineConfig, eos_token_ids: list[int] | tuple[int, ...] = (),
                 role: str = COLOCATED) -> None:
        self.cfg = cfg
        self.device = cfg.torch_device()
        self.model, self.model_config = load_model(cfg.model, dtype_for=lambda ckpt: cfg.torch_dtype(ckpt, self.device),
                                                   device=self.device, backend=cfg.attention_backend)
        mc = self.model_config
        self.dtype = next(self.model.parameters()).dtype
        self.block_size = cfg.block_size
        per_block = kv_bytes_per_block(mc.num_hidden_layers, cfg.block_size, mc.num_key_value_heads,
                                       mc.head_dim, self.dtype)
        self.num_blocks = kv_pool_blocks(cfg, per_block, self.device)
        # CUDA only; the graphs' padding rows get a scratch block. A prefill worker never decodes: no decode graphs
        graphs = graphs_apply(cfg, self.device) and role != PREFILL
        prefill_graphs = prefill_graphs_apply(cfg, self.device, role)      # LAPS buckets: CUDA, bucketing workers
        self.kv_caches = allocate_kv_cache(mc.num_hidden_layers,
                                           self.num_blocks + (1 if graphs or prefill_graphs else 0),
                                           cfg.block_size, mc.num_key_value_heads, mc.head_dim, self.dtype,
                                           self.device)
        self.sampler = Sampler(eos_token_ids=eos_token_ids, seed=cfg.seed)
        if self.device.type == "cpu" and self.dtype == torch.float32:
            native.load()            # build the CPU decode kernel now (about 1 s, once per machine), not in a step
        max_len = cfg.max_model_len or mc.max_position_embeddings
        pool = None
        self.prefill_graphs: PrefillGraphs | None = None   # LAPS bucket steps as CUDA graphs (prefill_graphs.py)
        if prefill_graphs:
            self.prefill_graphs = PrefillGraphs(self.model, self.kv_caches, cfg.block_size, graph_max_len(cfg, max_len),
                                                graph_buckets(cfg), scratch_block=self.num_blocks)
            pool = self.prefill_graphs.capture()        # the larger graphs first; the decode graphs share the pool
        self.graphs: DecodeGraphs | None = None        # decode steps as CUDA graphs (cuda_graphs.py)
        if graphs:
            self.graphs = DecodeGraphs(self.model, self.kv_caches, cfg.block_size, max_len, capture_sizes(cfg),
                                       scratch_block=self.num_blocks)
            self.graphs.capture(pool)

    @torch.inference_mode()
    def execute(self, batch: ModelInput) -> SampleOutput | None:
        """Run the model over the batch (writing its KV) and sample the requested rows."""
        dev = self.device
        hidden = self.graphs.execute(batch) if self.graphs is not None else None   # a decode step's graph replay
        if hidden is None and self.prefill_graphs is not None:
            hidden = self.prefill_graphs.execute(batch)          # a LAPS bucket's graph replay: real tokens' rows
        if hidden is None:
            meta = AttnMetadata.build(batch.query_lens, batch.seq_lens, batch.block_tables, self.block_size, dev)
            pad = batch.pad_to - len(batch.token_ids) if batch.pad_to > len(batch.token_ids) else 0
            ids = torch.tensor(batch.token_ids + [0] * pad, dtype=torch.long, device=dev)
            pos = torch.tensor(batch.positions + [0] * pad, dtype=torch.long, device=dev)
            hidden = self.model(ids, pos, self.kv_caches, meta)      # [real + pad, H]: padding rows come last
        prompt_lps = self._prompt_logprobs(hidden, batch) if batch.prompt_logprobs else None
        if not batch.sample_rows:
            return SampleOutput([], prompt_logprobs=prompt_lps) if prompt_lps is not None else None
        # hidden holds the real tokens in batch order (padding rows after them): each sequence's last token's row
        last = np.cumsum(np.asarray(batch.query_lens, dtype=np.int64)) - 1
        rows = torch.from_numpy(last[np.asarray(batch.sample_rows, dtype=np.int64)]).to(dev)
        logits = self.model.compute_logits(hidden[rows])
        grammars = batch.grammars if any(g is not None for g in batch.grammars) else None
        out = self.sampler.sample(logits, batch.params, batch.generators, batch.output_tokens, batch.prompt_tokens,
                                  grammars)
        out.prompt_logprobs = prompt_lps
        return out

    def _prompt_logprobs(self, hidden: torch.Tensor, batch: ModelInput) -> list[list[dict[int, float]]]:
        """Per spec, each target's raw logprob (log-softmax of the full logits) and the top k, computed over
        row chunks so a long prompt never holds prompt_len x vocab logits at once."""
        starts = [0, *accumulate(batch.query_lens)]
        step = max(1, PROMPT_LOGPROBS_ELEMS // self.model_config.vocab_size)
        out: list[list[dict[int, float]]] = []
        for spec in batch.prompt_logprobs:
            first = starts[spec.seq]
            entries: list[dict[int, float]] = []
            for a in range(0, len(spec.targets), step):
                targets = spec.targets[a:a + step]
                lp = torch.log_softmax(self.model.compute_logits(hidden[first + a:first + a + len(targets)]), dim=-1)
                tgt = torch.tensor(targets, dtype=torch.long, device=lp.device)
                chosen = lp.gather(1, tgt[:, None]).squeeze(1).tolist()
                if spec.k > 0:
                    vals, idx = lp.topk(min(spec.k, lp.shape[1]), dim=-1)
                    tops = [dict(zip(i, v)) for i, v in zip(idx.tolist(), vals.tolist())]
                else:
                    tops = [{} for _ in targets]
                entries += [{t: c, **top} for t, c, top in zip(targets, chosen, tops)]
            out.append(entries)
        return out
