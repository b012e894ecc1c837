"""The engine's Qwen3/Llama models over a paged KV cache against transformers, plus loader and backend errors."""
from __future__ import annotations

import json
import random
import shutil

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from tandem.engine.attention import (AttnMetadata, allocate_kv_cache, backend_names, get_backend,  # noqa: E402
                                     kv_bytes_per_block)
from tandem.engine.loader import ModelLoadError, load_model  # noqa: E402
from tandem.engine.models import ModelConfig  # noqa: E402
from tandem.engine.tiny_model import make_tiny_model, parameter_count  # noqa: E402

BLOCK = 16
NUM_BLOCKS = 48
TOL = 1e-4


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """A tied single-file Qwen3 and an untied Llama sharded into two files."""
    root = tmp_path_factory.mktemp("tiny")
    return {"qwen3": make_tiny_model(root / "qwen3", "qwen3", "1m", seed=1),
            "llama": make_tiny_model(root / "llama", "llama", "1m", seed=2, shards=2)}


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def pair(request, ckpts):
    """(our model, its config, the transformers model) for one architecture."""
    from transformers import AutoModelForCausalLM

    d = ckpts[request.param]
    ours, cfg = load_model(d, dtype=torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    return ours, cfg, hf


class Paged:
    """A fresh KV pool with shuffled, non-contiguous block tables, and a helper to run one flattened step."""

    def __init__(self, model, cfg, n_seqs: int, seed: int = 0):
        self.model, self.cfg = model, cfg
        self.kv = allocate_kv_cache(cfg.num_hidden_layers, NUM_BLOCKS, BLOCK, cfg.num_key_value_heads,
                                    cfg.head_dim, torch.float32, "cpu")
        free = list(range(1, NUM_BLOCKS))
        random.Random(seed).shuffle(free)
        per = (NUM_BLOCKS - 1) // n_seqs
        self.tables = [free[i * per:(i + 1) * per] for i in range(n_seqs)]
        self.cached = [0] * n_seqs

    def step(self, chunks: dict[int, list[int]]) -> list[torch.Tensor]:
        """Run one step with chunks[seq] = new tokens; returns per-sequence logits [n_new, vocab]."""
        seqs = sorted(chunks)
        q = [len(chunks[s]) for s in seqs]
        L = [self.cached[s] + len(chunks[s]) for s in seqs]
        meta = AttnMetadata.build(q, L, [self.tables[s] for s in seqs], BLOCK, "cpu")
        ids = torch.tensor([t for s in seqs for t in chunks[s]])
        with torch.inference_mode():
            logits = self.model.compute_logits(self.model(ids, AttnMetadata.positions(q, L), self.kv, meta))
        for s in seqs:
            self.cached[s] += len(chunks[s])
        return list(torch.split(logits, q))


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([tokens])).logits[0].float()


def prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 390, (n,), generator=g).tolist() for n in lengths]


def test_prefill_batch_matches_transformers(pair):
    """Protects: one flattened prefill step of 3 prompts (paged, shuffled blocks, GQA, RoPE) equals HF logits."""
    ours, cfg, hf = pair
    ps = prompts([7, 40, 19])
    run = Paged(ours, cfg, 3)
    out = run.step(dict(enumerate(ps)))
    for p, got in zip(ps, out):
        assert (got - hf_logits(hf, p)).abs().max().item() < TOL
    # RoPE frequencies (llama3-scaled for the llama checkpoint) equal transformers' own.
    assert torch.allclose(ours.model.rotary_emb._inv_freq, hf.model.rotary_emb.inv_freq.float(), rtol=1e-6, atol=0)


def test_tied_and_untied_embeddings(pair, ckpts):
    """Protects: tied checkpoints (no lm_head tensor) share the embedding; untied ones load lm_head separately."""
    ours, cfg, _ = pair
    tied = ours.lm_head.weight.data_ptr() == ours.model.embed_tokens.weight.data_ptr()
    assert tied == cfg.tie_word_embeddings == (cfg.architecture == "Qwen3ForCausalLM")


def test_batched_decode_matches_transformers(pair):
    """Protects: decode steps (query_len 1 for every sequence, one padded SDPA call) read the cached KV right."""
    ours, cfg, hf = pair
    ps = prompts([5, 33, 16], seed=1)
    run = Paged(ours, cfg, 3, seed=1)
    run.step(dict(enumerate(ps)))
    seqs = [list(p) for p in ps]
    got: list[list[torch.Tensor]] = [[] for _ in ps]
    for _ in range(4):
        new = [int(t) for t in torch.randint(0, 390, (3,))]
        for s, t in zip(seqs, new):
            s.append(t)
        for i, lg in enumerate(run.step({i: [new[i]] for i in range(3)})):
            got[i].append(lg[0])
    for s, rows in zip(seqs, got):
        ref = hf_logits(hf, s)[-4:]
        assert (torch.stack(rows) - ref).abs().max().item() < TOL


def test_chunked_prefill_on_cached_prefix_in_mixed_batch(pair):
    """Protects: a prefill chunk on top of cached KV (crossing a block boundary), mixed with a decode and a
    fresh prefill in the same step, gives HF's logits (causal mask offset by the cached length)."""
    ours, cfg, hf = pair
    long, short, fresh = prompts([45, 9, 12], seed=2)
    run = Paged(ours, cfg, 3, seed=2)
    first = run.step({0: long[:21], 1: short})
    assert (first[0] - hf_logits(hf, long[:21])).abs().max().item() < TOL
    nxt = 77
    out = run.step({0: long[21:], 1: [nxt], 2: fresh})
    assert (out[0] - hf_logits(hf, long)[21:]).abs().max().item() < TOL
    assert (out[1][0] - hf_logits(hf, short + [nxt])[-1]).abs().max().item() < TOL
    assert (out[2] - hf_logits(hf, fresh)).abs().max().item() < TOL


def test_metadata_slot_mapping_and_validation():
    """Protects: slot_mapping sends position p of a sequence to table[p // bs] * bs + p % bs; short tables fail."""
    meta = AttnMetadata.build([3, 1], [18, 5], [[7, 2], [4]], 16, "cpu")
    assert meta.slot_mapping.tolist() == [7 * 16 + 15, 2 * 16 + 0, 2 * 16 + 1, 4 * 16 + 4]
    assert meta.query_start_loc.tolist() == [0, 3, 4] and meta.seq_lens_t.tolist() == [18, 5]
    assert meta.block_tables.tolist() == [[7, 2], [4, 0]]
    assert (meta.max_query_len, meta.max_seq_len) == (3, 18)
    assert AttnMetadata.positions([3, 1], [18, 5]).tolist() == [15, 16, 17, 4]
    with pytest.raises(ValueError, match="KV blocks"):
        AttnMetadata.build([1], [17], [[3]], 16, "cpu")
    assert kv_bytes_per_block(2, 16, 2, 8, torch.float16) == 2 * 2 * 16 * 2 * 8 * 2


def test_backend_registry():
    """Protects: auto picks sdpa on CPU; unknown names and flash-on-CPU raise ValueError naming the choices."""
    assert get_backend(None, "cpu").name == "sdpa"
    assert get_backend("auto", torch.device("cpu")).name == "sdpa"
    with pytest.raises(ValueError, match="sdpa"):
        get_backend("no-such-backend", "cpu")
    with pytest.raises(ValueError, match="CUDA"):
        get_backend("flash", "cpu")
    assert backend_names() == ["flash", "sdpa"]


def test_model_registry_matches_config_architectures():
    """Protects: ModelConfig accepts exactly the architectures the engine has a class for (the config module
    names them so that it need not import the model classes that read it)."""
    from tandem.engine.models import ARCHITECTURES, MODEL_REGISTRY

    assert sorted(MODEL_REGISTRY) == sorted(ARCHITECTURES)


def test_loader_errors(ckpts, tmp_path):
    """Protects: clear ModelLoadError messages for a missing dir/config, no weights, missing/unexpected tensors,
    wrong shapes and unsupported architectures."""
    from safetensors.torch import load_file, save_file

    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(tmp_path / "empty")

    def copy(name):
        d = tmp_path / name
        shutil.copytree(ckpts["qwen3"], d)
        return d

    d = copy("noweights")
    (d / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_model(d)

    d = copy("missing")
    w = load_file(d / "model.safetensors")
    del w["model.layers.1.self_attn.k_norm.weight"]
    save_file(w, d / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"missing.*model\.layers\.1\.self_attn\.k_norm\.weight"):
        load_model(d)

    d = copy("shape")
    w = load_file(d / "model.safetensors")
    w["model.norm.weight"] = torch.ones(7)
    w["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(3)   # ignored, as HF ignores it
    save_file(w, d / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"shape mismatch.*model\.norm\.weight.*\[7\]"):
        load_model(d)

    d = copy("unexpected")
    w = load_file(d / "model.safetensors")
    w["model.layers.9.mlp.up_proj.weight"] = torch.ones(2, 2)
    save_file(w, d / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"unexpected.*model\.layers\.9\.mlp\.up_proj\.weight"):
        load_model(d)

    d = copy("arch")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["MambaForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="LlamaForCausalLM.*Qwen3ForCausalLM"):
        load_model(d)
    with pytest.raises(ValueError, match="Qwen3ForCausalLM"):
        ModelConfig.from_dict(cfg)


def test_tiny_model_sizes():
    """Protects: the advertised sizes (about 1M and 30M parameters) of the tiny checkpoints."""
    for arch in ("qwen3", "llama"):
        assert 0.8e6 < parameter_count(arch, "1m") < 1.2e6
        assert 27e6 < parameter_count(arch, "30m") < 33e6
