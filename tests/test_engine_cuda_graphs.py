"""Decode steps as CUDA graphs (engine/cuda_graphs.py, attention/static_decode.py).

On CPU: the static padded decode path (the code a graph captures, run eagerly) against the normal path, padding
that never touches a real KV block, which steps qualify and at which size, the flags. On a GPU (skipped here):
real capture and replay against eager outputs."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from tandem.cli.main import main  # noqa: E402
from tandem.engine.attention import AttnMetadata, allocate_kv_cache  # noqa: E402
from tandem.engine.attention.static_decode import flash_kvcache  # noqa: E402
from tandem.engine.config import EngineConfig, EngineError  # noqa: E402
from tandem.engine.cuda_graphs import (DecodeGraphs, capture_sizes, default_capture_sizes, graphs_apply,  # noqa: E402
                                       padded_size)
from tandem.engine.loader import load_model  # noqa: E402
from tandem.engine.model_input import ModelInput, PromptLogprobsSpec  # noqa: E402
from tandem.engine.model_runner import ModelRunner  # noqa: E402
from tandem.engine.tiny_model import make_tiny_model  # noqa: E402

BS = 8                  # tokens per block: contexts below cross block boundaries
MAX_LEN = 64            # static block table width: 8 blocks
NUM_BLOCKS = 48         # real blocks 0..47; the scratch block is 48
SCRATCH = NUM_BLOCKS
SIZES = [1, 2, 4, 8]
CONTEXTS = [7, 8, 9, 16, 17, 30, 41, 1]      # KV length before the decode step (mixed, across block ends)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen3", "qwen3", "1m", seed=3)


@pytest.fixture(scope="module")
def prefilled(ckpt):
    """The model, a KV pool (+ scratch block) holding the CONTEXTS sequences' prompts, their tables and tokens."""
    model, _ = load_model(ckpt, dtype=torch.float32)
    kv = allocate_kv_cache(model.config.num_hidden_layers, NUM_BLOCKS + 1, BS, model.config.num_key_value_heads,
                           model.config.head_dim, torch.float32, "cpu")
    free = list(range(NUM_BLOCKS))[::-1]                     # descending: tables are not contiguous runs
    tables = [[free.pop(0) for _ in range(-(-(n + 1) // BS))] for n in CONTEXTS]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in CONTEXTS]
    meta = AttnMetadata.build(CONTEXTS, CONTEXTS, tables, BS)
    with torch.inference_mode():
        model(torch.tensor(sum(prompts, [])), AttnMetadata.positions(CONTEXTS, CONTEXTS), kv, meta)
    nxt = torch.randint(0, 300, (len(CONTEXTS),), generator=g).tolist()
    return model, kv, tables, nxt


def _decode_batch(idx: list[int], tables, nxt) -> ModelInput:
    b = ModelInput()
    for i in idx:
        b.add([nxt[i]], CONTEXTS[i], tables[i])
    return b


def _eager(model, kv, b: ModelInput) -> torch.Tensor:
    meta = AttnMetadata.build(b.query_lens, b.seq_lens, b.block_tables, BS)
    with torch.inference_mode():
        return model(torch.tensor(b.token_ids), torch.tensor(b.positions), kv, meta)


@pytest.mark.parametrize("gather_bytes", [None, 1], ids=["one-chunk", "chunked-online-softmax"])
@pytest.mark.parametrize("idx", [[0, 3, 5], [1, 2, 4, 6, 7]], ids=["3-pad-4", "5-pad-8"])
def test_static_padded_decode_equals_the_normal_path(prefilled, idx, gather_bytes):
    model, kv0, tables, nxt = prefilled
    b = _decode_batch(idx, tables, nxt)
    kv_ref, kv_static = [t.clone() for t in kv0], [t.clone() for t in kv0]
    ref = _eager(model, kv_ref, b)
    extra = {} if gather_bytes is None else {"gather_bytes": gather_bytes}
    graphs = DecodeGraphs(model, kv_static, BS, MAX_LEN, SIZES, SCRATCH, **extra)
    size = padded_size(b, graphs.sizes)
    assert size == (4 if len(idx) == 3 else 8)
    graphs.load(b, size)
    with torch.inference_mode():
        out = graphs.forward_static(size)[:len(idx)]
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)
    assert torch.equal(model.compute_logits(out).argmax(-1), model.compute_logits(ref).argmax(-1))
    for a, r in zip(kv_static, kv_ref):                     # same K/V written at the real slots
        torch.testing.assert_close(a[:, :NUM_BLOCKS], r[:, :NUM_BLOCKS], atol=2e-5, rtol=1e-5)


def test_eager_decode_takes_a_strided_attention_output(prefilled, monkeypatch):
    """On an H100, CUDA's SDPA returned the decode groups' [n, Hkv, G, D] output laid out as [n, G, Hkv, D], and the
    sdpa backend's `.view` to [n, Hq, D] raised: the eager decode path must accept any layout (here made on CPU)."""
    from tandem.engine.attention import sdpa
    model, kv0, tables, nxt = prefilled
    monkeypatch.setattr(sdpa.native, "supports", lambda q, kv: False)      # the gather + SDPA path on CPU too
    b = _decode_batch([0, 3, 5, 6], tables, nxt)
    ref = _eager(model, [t.clone() for t in kv0], b)
    real = torch.nn.functional.scaled_dot_product_attention

    def strided(q, k, v, **kw):
        o = real(q, k, v, **kw)
        return o.transpose(1, 2).contiguous().transpose(1, 2)             # same values, [n, G, Hkv, D] in memory

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", strided)
    assert not strided(*(torch.zeros(2, 2, 2, 4),) * 3).is_contiguous()
    torch.testing.assert_close(_eager(model, [t.clone() for t in kv0], b), ref, atol=0, rtol=0)


def test_padding_never_writes_a_real_block(prefilled):
    model, kv0, tables, nxt = prefilled
    idx = [0, 3, 5]
    b = _decode_batch(idx, tables, nxt)
    kv = [t.clone() for t in kv0]
    graphs = DecodeGraphs(model, kv, BS, MAX_LEN, SIZES, SCRATCH)
    graphs.load(b, 8)                                        # five padding rows
    with torch.inference_mode():
        graphs.forward_static(8)
    written = {tables[i][CONTEXTS[i] // BS] * BS + CONTEXTS[i] % BS for i in idx}
    for before, after in zip(kv0, kv):
        flat_b, flat_a = before.flatten(1, 2), after.flatten(1, 2)      # [2, slots, Hkv, D]
        changed = {int(s) for s in (flat_b != flat_a).flatten(2).any(-1).any(0).nonzero().flatten()}
        assert changed - written == {SCRATCH * BS}           # besides the real rows' slots: the scratch slot only
    assert graphs.slot_mapping[3:8].eq(SCRATCH * BS).all() and graphs.seq_lens[3:8].eq(1).all()
    assert graphs.block_tables[3:8].eq(SCRATCH).all()        # padding rows read only the scratch block
    assert graphs.block_tables[0, -1].item() == SCRATCH      # a real row's unused table entries too


def test_static_path_runs_again_with_new_inputs(prefilled):
    """The static buffers and the backend's per-step tensors are refreshed between steps (a replay reuses them)."""
    model, kv0, tables, nxt = prefilled
    kv_ref, kv_static = [t.clone() for t in kv0], [t.clone() for t in kv0]
    graphs = DecodeGraphs(model, kv_static, BS, MAX_LEN, SIZES, SCRATCH)
    for idx in ([0, 1, 2, 3, 4, 5, 6], [7, 4]):
        b = _decode_batch(idx, tables, nxt)
        ref = _eager(model, kv_ref, b)
        size = padded_size(b, graphs.sizes)
        graphs.load(b, size)
        with torch.inference_mode():
            torch.testing.assert_close(graphs.forward_static(size)[:len(idx)], ref, atol=2e-5, rtol=1e-5)


def test_size_selection(prefilled):
    model, kv0, tables, nxt = prefilled
    dec = lambda n: _decode_batch(list(range(n)), tables, nxt)        # noqa: E731
    assert [padded_size(dec(n), SIZES) for n in (1, 2, 3, 4, 5, 8)] == [1, 2, 4, 4, 8, 8]
    assert padded_size(ModelInput(), SIZES) is None
    assert padded_size(dec(5), [1, 2, 4]) is None                       # larger than the largest size
    mixed = dec(2)
    mixed.add([1, 2, 3], 0, [40])                                       # a prefill chunk: not pure decode
    assert padded_size(mixed, SIZES) is None
    lp = dec(2)
    lp.prompt_logprobs.append(PromptLogprobsSpec(0, [], 1))
    assert padded_size(lp, SIZES) is None
    graphs = DecodeGraphs(model, [t.clone() for t in kv0], BS, MAX_LEN, SIZES, SCRATCH)
    assert graphs.size_for(dec(3)) is None                              # CPU: never a graph


def test_capture_sizes_and_when_graphs_apply(ckpt):
    assert default_capture_sizes(256) == [1, 2, 4] + list(range(8, 257, 8))
    assert default_capture_sizes(3) == [1, 2, 4]
    assert default_capture_sizes(100)[-2:] == [96, 104]                 # every batch up to max_num_seqs fits
    assert default_capture_sizes(10_000)[-1] == 512
    cfg = EngineConfig(model=str(ckpt), max_num_seqs=16)
    assert capture_sizes(cfg) == [1, 2, 4, 8, 16]
    assert capture_sizes(EngineConfig(model=str(ckpt), cuda_graph_sizes=[8, 1, 4, 1])) == [1, 4, 8]
    assert not graphs_apply(cfg, torch.device("cpu"))
    assert graphs_apply(cfg, torch.device("cuda"))
    assert not graphs_apply(EngineConfig(model=str(ckpt), enforce_eager=True), torch.device("cuda"))


def test_cpu_runner_captures_nothing_and_reserves_no_block(ckpt):
    r = ModelRunner(EngineConfig(model=str(ckpt), device="cpu", num_kv_blocks=20, cuda_graph_sizes=(1, 2)))
    assert r.graphs is None and r.kv_caches[0].shape[1] == r.num_blocks == 20


@pytest.mark.parametrize("bad", [[0], [], (2, -1), (True,), "1,2", [1.5]])
def test_engine_config_rejects_bad_graph_sizes(ckpt, bad):
    with pytest.raises(EngineError, match="cuda_graph_sizes"):
        EngineConfig(model=str(ckpt), cuda_graph_sizes=bad)
    with pytest.raises(EngineError, match="enforce_eager"):
        EngineConfig(model=str(ckpt), enforce_eager="yes")


@pytest.mark.parametrize("cmd", ["serve", "profile"])
@pytest.mark.parametrize("value,needle", [("0", "must be >= 1"), ("1,x", "expected an integer"),
                                          (",", "comma-separated")])
def test_cli_rejects_bad_graph_sizes_in_one_line(tmp_path, capsys, cmd, value, needle):
    rc = main([cmd, "--model", str(tmp_path), "--cuda-graph-sizes", value])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("tandem: error: ")
    assert "--cuda-graph-sizes" in err[0] and needle in err[0]


def test_serve_passes_the_flags_to_every_worker_engine(ckpt):
    from tandem.cli import serve_cmd
    from tandem.cli.common import Parser
    p = Parser(prog="tandem")
    serve_cmd.add_parser(p.add_subparsers())
    args = p.parse_args(["serve", "--model", str(ckpt), "--colocated", "1", "--policy", "vllm", "--enforce-eager",
                         "--cuda-graph-sizes", "4,1,2"])
    eng = serve_cmd._cluster_config(args).engine_args
    assert eng["enforce_eager"] is True and EngineConfig(model=str(ckpt), **eng).cuda_graph_sizes == (1, 2, 4)
    plain = serve_cmd._cluster_config(p.parse_args(["serve", "--model", str(ckpt)])).engine_args
    assert "enforce_eager" not in plain and "cuda_graph_sizes" not in plain


# --------------------------------------------------------------------------- CUDA: real capture and replay

def _cuda_case(ckpt, dtype: str, block_size: int):
    """A CUDA runner with graphs for 1, 2, 4, 8, its prompts prefilled eagerly, and a 5-sequence decode batch."""
    r = ModelRunner(EngineConfig(model=str(ckpt), device="cuda", dtype=dtype, block_size=block_size,
                                 num_kv_blocks=8 * -(-64 // block_size), max_model_len=512, cuda_graph_sizes=SIZES))
    per = -(-64 // block_size)
    tables = [list(range(i * per, (i + 1) * per)) for i in range(5)]
    lens = [5, 17, 33, 40, 63]
    pre = ModelInput()
    for L, t in zip(lens, tables):
        pre.add(list(range(1, L)), 0, t)
    r.execute(pre)
    dec = ModelInput()
    for L, t in zip(lens, tables):
        dec.add([7], L - 1, t)
    return r, dec


@cuda
@pytest.mark.parametrize("dtype,block_size", [
    ("float32", 16),
    pytest.param("float16", 256, marks=pytest.mark.skipif(flash_kvcache() is None, reason="needs flash_attn")),
])
def test_cuda_replay_equals_eager(ckpt, dtype, block_size):
    r, dec = _cuda_case(ckpt, dtype, block_size)
    g = r.graphs
    assert sorted(g.graphs) == SIZES and g.capture_s > 0 and g.pool_bytes >= 0
    assert g.attention.paged == (block_size % 256 == 0)
    kv_eager = [t.clone() for t in r.kv_caches]
    meta = AttnMetadata.build(dec.query_lens, dec.seq_lens, dec.block_tables, block_size, "cuda")
    with torch.inference_mode():
        ref = r.model(torch.tensor(dec.token_ids, device="cuda"), torch.tensor(dec.positions, device="cuda"),
                      kv_eager, meta)
        assert g.size_for(dec) == 8
        out = g.execute(dec).clone()
    tol = 1e-4 if dtype == "float32" else 2e-2
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    real = r.num_blocks                                      # the scratch block is the last one
    for a, e in zip(r.kv_caches, kv_eager):
        torch.testing.assert_close(a[:, :real], e[:, :real], atol=tol, rtol=tol)


@cuda
def test_cuda_engine_greedy_tokens_equal_enforce_eager(ckpt):
    from tandem.engine.llm import LLM
    from tandem.engine.sampling_params import SamplingParams
    prompts = [[1 + i, 2, 3 + i, 4] * (i + 1) for i in range(5)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    kw = dict(device="cuda", dtype="float32", num_kv_blocks=64, max_model_len=256, cuda_graph_sizes=(1, 2, 4, 8))
    graphed = [o.token_ids for o in LLM(str(ckpt), **kw).generate(prompts, params)]
    eager = [o.token_ids for o in LLM(str(ckpt), enforce_eager=True, **kw).generate(prompts, params)]
    assert graphed == eager
