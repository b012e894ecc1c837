"""LAPS short-prefill buckets as CUDA graphs (engine/prefill_graphs.py, attention/static_prefill.py).

On CPU: the static bucket attention against the sdpa backend, the captured code run eagerly (`forward_static`)
against the eager unpadded step, padding that never touches a real KV block, which steps replay, when graphs are
captured, the knobs, and the engine's routing of a bucket step through the graph path. On a GPU (skipped here): real
capture and replay against the eager path."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from tandem.engine.attention import AttnMetadata, allocate_kv_cache  # noqa: E402
from tandem.engine.attention.sdpa import SdpaBackend  # noqa: E402
from tandem.engine.config import EngineConfig, EngineError  # noqa: E402
from tandem.engine.llm_engine import LLMEngine  # noqa: E402
from tandem.engine.loader import load_model  # noqa: E402
from tandem.engine.model_input import ModelInput  # noqa: E402
from tandem.engine.model_runner import ModelRunner  # noqa: E402
from tandem.engine.prefill_graphs import (PrefillGraphs, default_buckets, graph_buckets, graph_max_len,  # noqa: E402
                                          prefill_graphs_apply)
from tandem.engine.sampling_params import SamplingParams  # noqa: E402
from tandem.engine.tiny_model import make_tiny_model  # noqa: E402
from tandem.policy.laps.buckets import Bucket  # noqa: E402

BS = 8                  # tokens per block: histories below end inside blocks
MAX_LEN = 64            # static block table width: 8 blocks
NUM_BLOCKS = 40         # real blocks 0..39; the scratch block is 40
SCRATCH = NUM_BLOCKS
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# (bucket, rows as (history, new tokens)): histories of 0, inside a block and on a block end; a row of one token
CASES = {
    "8x4-3rows": (Bucket(8, 4), [(0, 8), (13, 3), (21, 5)]),
    "16x2-2rows": (Bucket(16, 2), [(16, 16), (40, 1)]),
    "8x1-1row": (Bucket(8, 1), [(31, 7)]),
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen3", "qwen3", "1m", seed=5)


def _tables(rows: list[tuple[int, int]]) -> list[list[int]]:
    """Each row's blocks for its history + new tokens, taken from the top of the pool down (not contiguous runs)."""
    free = list(range(NUM_BLOCKS))[::-1]
    return [[free.pop(0) for _ in range(-(-(h + n) // BS))] for h, n in rows]


def _batch(rows: list[tuple[int, int]], tables: list[list[int]], tokens: list[list[int]], bucket: Bucket | None):
    """A step of re-prefills: row i's new tokens on top of its history, marked with its LAPS bucket."""
    b = ModelInput()
    for (h, n), t, ids in zip(rows, tables, tokens):
        b.add(ids[h:h + n], h, t)
    if bucket is not None:
        b.pad_to, b.bucket = bucket.padded_tokens, (bucket.tokens, bucket.batch)
    return b


def _changed_slots(before: torch.Tensor, after: torch.Tensor) -> set[int]:
    """Cache slots (block * BS + offset) whose K or V differs."""
    fb, fa = before.flatten(1, 2), after.flatten(1, 2)                      # [2, slots, Hkv, D]
    return {int(s) for s in (fb != fa).flatten(2).any(-1).any(0).nonzero().flatten()}


def _real_slots(rows, tables) -> set[int]:
    return {tables[i][p // BS] * BS + p % BS for i, (h, n) in enumerate(rows) for p in range(h, h + n)}


# --------------------------------------------------------------------------- the attention alone

@pytest.mark.parametrize("gather_bytes", [None, 1], ids=["one-chunk", "chunked-online-softmax"])
@pytest.mark.parametrize("heads", [(4, 2), (6, 2), (2, 2)], ids=["gqa2", "gqa3", "mha"])
@pytest.mark.parametrize("case", list(CASES))
def test_static_prefill_attention_equals_the_sdpa_backend(case, heads, gather_bytes):
    """Protects the bucket attention itself: laid out as a padded bucket (garbage in every padding slot's q/k/v, a
    pool of random values), it writes exactly the K/V the sdpa backend writes at every real slot and nothing but the
    scratch block besides, and every real token's output equals the sdpa backend's (causal over the new tokens, full
    over the history, GQA), in one key chunk and in one chunk per block merged by the online softmax."""
    bucket, rows = CASES[case]
    hq, hkv = heads
    D = 16
    g = torch.Generator().manual_seed(10 * list(CASES).index(case) + hq)
    kv0 = torch.randn(2, NUM_BLOCKS + 1, BS, hkv, D, generator=g)
    tables = _tables(rows)
    batch = _batch(rows, tables, [list(range(h + n)) for h, n in rows], bucket)
    N = len(batch.token_ids)
    q, k, v = torch.randn(N, hq, D, generator=g), torch.randn(N, hkv, D, generator=g), torch.randn(N, hkv, D, generator=g)
    scale = D ** -0.5
    kv_ref, kv_static = kv0.clone(), kv0.clone()
    meta = AttnMetadata.build(batch.query_lens, batch.seq_lens, batch.block_tables, BS)
    ref = SdpaBackend().forward(q, k, v, kv_ref, meta, scale)

    stub = torch.nn.Linear(4, 1)
    stub.config = SimpleNamespace(hidden_size=4)
    extra = {} if gather_bytes is None else {"gather_bytes": gather_bytes}
    graphs = PrefillGraphs(stub, [kv_static], BS, MAX_LEN, [bucket], SCRATCH, **extra)
    dst = graphs.load(batch, bucket)
    P = bucket.padded_tokens
    qp, kp, vp = torch.randn(P, hq, D, generator=g), torch.randn(P, hkv, D, generator=g), torch.randn(P, hkv, D, generator=g)
    qp[dst], kp[dst], vp[dst] = q, k, v
    out = graphs.attention.forward(qp, kp, vp, kv_static, graphs._metas[bucket], scale)
    n_chunks = len(graphs._metas[bucket].scratch["static_prefill"].blocks)
    assert n_chunks == (1 if gather_bytes is None else MAX_LEN // BS)
    torch.testing.assert_close(out[dst], ref, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(out).all()                                    # padding slots attend to key 0, not to none
    assert torch.equal(kv_static[:, :NUM_BLOCKS], kv_ref[:, :NUM_BLOCKS])
    assert _changed_slots(kv0, kv_static) - _real_slots(rows, tables) <= set(range(SCRATCH * BS, (SCRATCH + 1) * BS))


# --------------------------------------------------------------------------- the model over a bucket

@pytest.fixture(scope="module")
def model(ckpt):
    m, _ = load_model(ckpt, dtype=torch.float32)
    return m


def _with_histories(model, rows, seed: int):
    """A pool (+ scratch block) holding each row's history KV (prefilled eagerly), the tables and every row's tokens."""
    kv = allocate_kv_cache(model.config.num_hidden_layers, NUM_BLOCKS + 1, BS, model.config.num_key_value_heads,
                           model.config.head_dim, torch.float32, "cpu")
    tables = _tables(rows)
    g = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(0, 400, (h + n,), generator=g).tolist() for h, n in rows]
    hist = [(i, h) for i, (h, _) in enumerate(rows) if h]
    if hist:
        lens = [h for _, h in hist]
        meta = AttnMetadata.build(lens, lens, [tables[i] for i, _ in hist], BS)
        with torch.inference_mode():
            model(torch.tensor(sum((tokens[i][:h] for i, h in hist), [])), AttnMetadata.positions(lens, lens), kv, meta)
    return kv, tables, tokens


def _eager(model, kv, b: ModelInput) -> torch.Tensor:
    meta = AttnMetadata.build(b.query_lens, b.seq_lens, b.block_tables, BS)
    with torch.inference_mode():
        return model(torch.tensor(b.token_ids), torch.tensor(b.positions), kv, meta)


@pytest.mark.parametrize("gather_bytes", [None, 1], ids=["one-chunk", "chunked-online-softmax"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_bucket_run_statically_equals_the_eager_unpadded_step(model, case, gather_bytes):
    """Protects what a replay computes: the captured code of a bucket, run eagerly, gives the real tokens the hidden
    states of the eager unpadded step (so the same greedy first tokens) and writes the same K/V at every real slot,
    and its padding writes no slot of a real block (only the scratch block)."""
    bucket, rows = CASES[case]
    kv0, tables, tokens = _with_histories(model, rows, seed=len(case))
    b = _batch(rows, tables, tokens, bucket)
    kv_ref, kv_static = [t.clone() for t in kv0], [t.clone() for t in kv0]
    ref = _eager(model, kv_ref, b)
    extra = {} if gather_bytes is None else {"gather_bytes": gather_bytes}
    graphs = PrefillGraphs(model, kv_static, BS, MAX_LEN, [bucket, Bucket(8, 1)], SCRATCH, **extra)
    dst = graphs.load(b, bucket)
    with torch.inference_mode():
        out = graphs.forward_static(bucket)[dst]
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)
    last = torch.tensor([sum(n for _, n in rows[:i + 1]) - 1 for i in range(len(rows))])
    assert torch.equal(model.compute_logits(out[last]).argmax(-1), model.compute_logits(ref[last]).argmax(-1))
    real = _real_slots(rows, tables)
    scratch = set(range(SCRATCH * BS, (SCRATCH + 1) * BS))
    for before, a, r in zip(kv0, kv_static, kv_ref):
        torch.testing.assert_close(a[:, :NUM_BLOCKS], r[:, :NUM_BLOCKS], atol=2e-5, rtol=1e-5)
        assert _changed_slots(before, a) - real <= scratch          # padding: the scratch block only
    assert graphs.slot_mapping[dst].div(BS, rounding_mode="floor").lt(NUM_BLOCKS).all()
    pad = torch.ones(bucket.padded_tokens, dtype=torch.bool)
    pad[dst] = False
    assert graphs.slot_mapping[:bucket.padded_tokens][pad].div(BS, rounding_mode="floor").eq(SCRATCH).all()
    assert graphs.block_tables[len(rows):bucket.batch].eq(SCRATCH).all()   # padding rows read the scratch block only


def test_the_static_path_runs_again_with_new_inputs(model):
    """Protects replays in a row: the static buffers and the backend's per-step tensors are refreshed between steps,
    across buckets of other shapes (they share the buffers) and back."""
    graphs = None
    kv_ref = kv_static = None
    for case in ("8x4-3rows", "16x2-2rows", "8x4-3rows"):
        bucket, rows = CASES[case]
        kv0, tables, tokens = _with_histories(model, rows, seed=7)
        if graphs is None:
            kv_ref, kv_static = [t.clone() for t in kv0], [t.clone() for t in kv0]
            graphs = PrefillGraphs(model, kv_static, BS, MAX_LEN, [Bucket(8, 4), Bucket(16, 2)], SCRATCH)
        else:                                  # same tables: load the new histories into both pools
            for r, s, k in zip(kv_ref, kv_static, kv0):
                r.copy_(k)
                s.copy_(k)
        b = _batch(rows, tables, tokens, bucket)
        ref = _eager(model, kv_ref, b)
        dst = graphs.load(b, bucket)
        with torch.inference_mode():
            torch.testing.assert_close(graphs.forward_static(bucket)[dst], ref, atol=2e-5, rtol=1e-5)


# --------------------------------------------------------------------------- which steps replay, when graphs exist

class _EagerGraph:
    """Stands in for a captured torch.cuda.CUDAGraph on CPU: replay() runs the captured code eagerly."""

    def __init__(self, graphs: PrefillGraphs, bucket: Bucket) -> None:
        self.graphs, self.bucket, self.replays = graphs, bucket, 0

    def replay(self) -> None:
        self.replays += 1
        self.graphs.forward_static(self.bucket)


def test_which_steps_replay_and_in_which_bucket(model):
    """Protects the choice of replaying: never without captured graphs (CPU, enforce_eager); with them, only a step
    marked with a captured bucket that holds its rows and whose sequences fit the key width."""
    bucket, rows = CASES["8x4-3rows"]
    kv, tables, tokens = _with_histories(model, rows, seed=1)
    graphs = PrefillGraphs(model, kv, BS, MAX_LEN, [Bucket(8, 4), Bucket(16, 2)], SCRATCH)
    b = _batch(rows, tables, tokens, bucket)
    assert graphs.bucket_for(b) is None and graphs.execute(b) is None        # nothing captured (CPU)
    graphs.graphs = {x: _EagerGraph(graphs, x) for x in graphs.buckets}
    assert graphs.bucket_for(b) == Bucket(8, 4)
    assert graphs.bucket_for(_batch(rows, tables, tokens, None)) is None      # not a bucket step
    assert graphs.bucket_for(_batch(rows, tables, tokens, Bucket(8, 8))) is None   # bucket not captured
    assert graphs.bucket_for(_batch(rows, tables, tokens, Bucket(16, 2))) is None  # 3 rows in a batch of 2
    assert graphs.bucket_for(_batch([(0, 9)], [[0, 1]], [list(range(9))], Bucket(8, 4))) is None  # 9 tokens > 8
    long = [(60, 5)]
    assert graphs.bucket_for(_batch(long, [list(range(9))], [list(range(65))], Bucket(8, 4))) is None  # 65 > 64
    fit = [(56, 8)]
    assert graphs.bucket_for(_batch(fit, [list(range(8))], [list(range(64))], Bucket(8, 4))) == Bucket(8, 4)
    assert graphs.max_len == MAX_LEN and PrefillGraphs(model, kv, BS, 60, [bucket], SCRATCH).max_len == 64


def test_when_prefill_graphs_are_captured_and_which_buckets(ckpt):
    """Protects where graphs are chosen: on CUDA only, never with enforce_eager, only on workers that run LAPS bucket
    steps (a LAPS prefill worker with laps_graphs, an AMPD+LAPS decode worker whose local prefills AWD batches; not
    laps-no-graph, not other policies, not a colocated engine);
    and which buckets: the grid's within max_num_batched_tokens and max_num_seqs, or laps_graph_buckets within them."""
    cuda_dev, cpu = torch.device("cuda"), torch.device("cpu")
    laps = EngineConfig(model=str(ckpt), policy="laps")
    assert prefill_graphs_apply(laps, cuda_dev, "prefill")
    assert not prefill_graphs_apply(laps, cpu, "prefill")
    assert not prefill_graphs_apply(laps, cuda_dev, "colocated") and not prefill_graphs_apply(laps, cuda_dev, "decode")
    ampd_laps = EngineConfig(model=str(ckpt), policy="ampd+laps")             # AWD batches local prefills too
    assert prefill_graphs_apply(ampd_laps, cuda_dev, "decode") and prefill_graphs_apply(ampd_laps, cuda_dev, "prefill")
    assert not prefill_graphs_apply(EngineConfig(model=str(ckpt), policy="ampd+laps-no-local-awd"), cuda_dev, "decode")
    assert not prefill_graphs_apply(EngineConfig(model=str(ckpt), policy="laps", enforce_eager=True), cuda_dev,
                                    "prefill")
    assert not prefill_graphs_apply(EngineConfig(model=str(ckpt), policy="laps-no-graph"), cuda_dev, "prefill")
    assert prefill_graphs_apply(EngineConfig(model=str(ckpt), policy="laps-no-split"), cuda_dev, "prefill")
    assert not prefill_graphs_apply(EngineConfig(model=str(ckpt), policy="sglang-pd"), cuda_dev, "prefill")
    assert not prefill_graphs_apply(EngineConfig(model=str(ckpt), policy="laps", laps_graph_buckets=()), cuda_dev,
                                    "prefill")
    got = {(b.tokens, b.batch) for b in graph_buckets(laps)}                 # budget 2048, 256 sequences
    assert len(got) == 36 and (256, 8) in got and (8, 64) in got and (256, 16) not in got and (64, 64) not in got
    small = EngineConfig(model=str(ckpt), max_num_batched_tokens=64, max_num_seqs=4)
    assert [(b.tokens, b.batch) for b in default_buckets(small)] == [(8, 1), (8, 2), (8, 4), (16, 1), (16, 2),
                                                                    (16, 4), (32, 1), (32, 2), (64, 1)]
    chosen = EngineConfig(model=str(ckpt), laps_graph_buckets=[[16, 4], (8, 2), (8, 2), (256, 16)])
    assert chosen.laps_graph_buckets == ((8, 2), (16, 4), (256, 16))
    assert graph_buckets(chosen) == [Bucket(8, 2), Bucket(16, 4)]            # 256 x 16 > the 2048-token budget
    assert graph_max_len(laps, 40960) == 4096 and graph_max_len(laps, 512) == 512
    assert graph_max_len(EngineConfig(model=str(ckpt), laps_graph_max_len=1000), 40960) == 1000


@pytest.mark.parametrize("field,bad", [("laps_graph_buckets", [(8, 0)]), ("laps_graph_buckets", [8, 4]),
                                       ("laps_graph_buckets", "8x4"), ("laps_graph_buckets", [(8, 4, 1)]),
                                       ("laps_graph_max_len", 0), ("laps_graph_max_len", True)])
def test_engine_config_rejects_bad_prefill_graph_knobs(ckpt, field, bad):
    """Protects the knobs' validation: a bad value is an EngineError naming the knob."""
    with pytest.raises(EngineError, match=field):
        EngineConfig(model=str(ckpt), **{field: bad})


def test_cpu_runner_captures_no_prefill_graph(ckpt):
    """Protects the CPU default: a LAPS prefill worker's runner on CPU has no prefill graphs and no scratch block."""
    r = ModelRunner(EngineConfig(model=str(ckpt), device="cpu", policy="laps", num_kv_blocks=20), role="prefill")
    assert r.prefill_graphs is None and r.graphs is None and r.kv_caches[0].shape[1] == r.num_blocks == 20


# --------------------------------------------------------------------------- the engine's bucket steps

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
PROMPTS = [list(range(5, 25)), list(range(30, 60)), list(range(100, 200))]     # 20, 30 and 100 tokens: (128, 4)


def _prefill(path: str, policy: str, graphed: bool, **kw) -> tuple[dict, list, int]:
    """Prefill PROMPTS on a prefill engine: {request: (KV payload, first token)}, each step's bucket and how many
    steps replayed a prefill graph; `graphed` gives a CPU runner prefill graphs of (128, 4) whose replay runs the
    captured code eagerly."""
    eng = LLMEngine(EngineConfig(model=path, policy=policy, num_kv_blocks=64, max_model_len=512, **kw),
                    role="prefill", worker_id=0)
    if graphed:
        _give_eager_graphs(eng, [Bucket(128, 4)])
    r = eng.runner
    for i, p in enumerate(PROMPTS):
        eng.add_prefill(f"r{i}", p, GREEDY, f"s{i}", l_hist=0)
    done, buckets, replayed = {}, [], 0
    for _ in range(100_000):                       # AWD holds the batch for its window (20 ms of the engine's clock)
        prep = eng.prepare_step()
        if prep.batch is not None:
            buckets.append(prep.batch.bucket)
            replayed += r.prefill_graphs is not None and r.prefill_graphs.bucket_for(prep.batch) is not None
        eng.finish_step(prep, eng.execute_step(prep))
        eng.core_events.clear()
        for i in range(len(PROMPTS)):
            rid = f"r{i}"
            if rid not in done and eng.requests[rid].first_token is not None:
                payload, tok, _ = eng.export_new_kv(rid)
                done[rid] = (payload.data.clone(), tok)
        if len(done) == len(PROMPTS):
            return done, buckets, replayed
    raise AssertionError("the prefills did not finish")


def test_the_engine_replays_a_bucket_step_with_the_unpadded_first_tokens_and_kv(ckpt):
    """Protects the engine's routing end to end: a LAPS prefill worker marks its short batch with its bucket (128, 4),
    the runner replays that bucket's graph (here its captured code, eagerly), and the first tokens equal the
    unpadded sglang-pd run's and every KV entry sent back matches it to float32 rounding."""
    graphed, buckets, replays = _prefill(str(ckpt), "laps", graphed=True)
    plain, plain_buckets, _ = _prefill(str(ckpt), "sglang-pd", graphed=False)
    assert buckets == [(128, 4)] and set(plain_buckets) == {None} and replays == 1
    assert graphed["r0"][0].shape == plain["r0"][0].shape
    for rid in plain:
        assert graphed[rid][1] == plain[rid][1]
        torch.testing.assert_close(graphed[rid][0], plain[rid][0], atol=2e-5, rtol=1e-5)


def _give_eager_graphs(eng: LLMEngine, buckets: list[Bucket]) -> None:
    """What ModelRunner does on CUDA (a scratch block, prefill graphs of `buckets`), with replays that run the
    captured code eagerly: the engine's bucket steps go through the graph path on CPU."""
    r = eng.runner
    mc = r.model_config
    r.kv_caches = allocate_kv_cache(mc.num_hidden_layers, r.num_blocks + 1, r.block_size, mc.num_key_value_heads,
                                    mc.head_dim, r.dtype, r.device)
    r.prefill_graphs = PrefillGraphs(r.model, r.kv_caches, r.block_size, 512, buckets, r.num_blocks)
    r.prefill_graphs.graphs = {b: _EagerGraph(r.prefill_graphs, b) for b in r.prefill_graphs.buckets}


def _sessions(path: str, policy: str, graphed: bool) -> tuple[dict, list]:
    """Two rounds of three sessions on a decode worker (the second: 4 new tokens on a 22-34 token history, not
    block-aligned): each session's conversation and every step's bucket and whether it replayed."""
    eng = LLMEngine(EngineConfig(model=path, policy=policy, num_kv_blocks=64, max_model_len=512), role="decode")
    if graphed:
        _give_eager_graphs(eng, [Bucket(32, 4), Bucket(8, 4)])
    pg = eng.runner.prefill_graphs
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    convs = {f"s{i}": list(range(5 + i, 25 + 7 * i)) for i in range(3)}          # 20, 26 and 32 tokens
    steps = []
    for rnd in range(2):
        for sid, conv in convs.items():
            eng.add_request(f"{sid}-{rnd}", conv, params, session_id=sid)
        outs: dict[str, list[int]] = {}
        for _ in range(100_000):
            prep = eng.prepare_step()
            if prep.batch is not None:
                steps.append((prep.batch.bucket, pg is not None and pg.bucket_for(prep.batch) is not None))
            outs.update((o.request_id, o.token_ids) for o in eng.finish_step(prep, eng.execute_step(prep))
                        if o.finished)
            if len(outs) == len(convs):
                break
        for sid in convs:
            convs[sid] = convs[sid] + outs[f"{sid}-{rnd}"] + [40 + rnd, 41, 42]
    return convs, steps


def test_a_decode_worker_replays_its_batched_local_re_prefills(ckpt):
    """Protects bucket steps on cached history through the engine: an AMPD+LAPS decode worker's AWD batches of local
    prefills (first rounds in (32, 4), second-round re-prefills on their resident history in (8, 4)) go through the
    graph path, and every session's tokens equal the same worker's without local AWD (unpadded, eager)."""
    graphed, steps = _sessions(str(ckpt), "ampd+laps", graphed=True)
    plain, plain_steps = _sessions(str(ckpt), "ampd+laps-no-local-awd", graphed=False)
    assert [s for s in steps if s[0] is not None] == [((32, 4), True), ((8, 4), True)]
    assert not any(replayed for b, replayed in steps if b is None)
    assert all(b is None for b, _ in plain_steps)
    assert graphed == plain


# --------------------------------------------------------------------------- CUDA: real capture and replay

@cuda
def test_cuda_prefill_graph_replay_equals_eager(ckpt):
    """Protects capture and replay on a GPU: two buckets captured at start (time and pool reported), a re-prefill
    batch replayed in the (8, 4) graph gives the eager step's hidden states and K/V."""
    r = ModelRunner(EngineConfig(model=str(ckpt), device="cuda", dtype="float32", block_size=BS, policy="laps",
                                 num_kv_blocks=NUM_BLOCKS, max_model_len=MAX_LEN, laps_graph_buckets=[(8, 4), (16, 2)],
                                 cuda_graph_sizes=(1, 2)), role="prefill")
    g = r.prefill_graphs
    assert set(g.graphs) == {Bucket(8, 4), Bucket(16, 2)} and g.capture_s > 0 and g.pool_bytes >= 0
    assert r.graphs is None and r.kv_caches[0].shape[1] == NUM_BLOCKS + 1      # a prefill worker never decodes
    bucket, rows = CASES["8x4-3rows"]
    tables = _tables(rows)
    tokens = [list(range(3, 3 + h + n)) for h, n in rows]
    hist = ModelInput()
    for (h, _), t, ids in zip(rows, tables, tokens):
        if h:
            hist.add(ids[:h], 0, t)
    r.execute(hist)                                                    # histories, eagerly
    b = _batch(rows, tables, tokens, bucket)
    kv_eager = [t.clone() for t in r.kv_caches]
    meta = AttnMetadata.build(b.query_lens, b.seq_lens, b.block_tables, BS, "cuda")
    with torch.inference_mode():
        ref = r.model(torch.tensor(b.token_ids, device="cuda"), torch.tensor(b.positions, device="cuda"),
                      kv_eager, meta)
        assert g.bucket_for(b) == bucket
        out = g.execute(b)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    for a, e in zip(r.kv_caches, kv_eager):
        torch.testing.assert_close(a[:, :NUM_BLOCKS], e[:, :NUM_BLOCKS], atol=1e-4, rtol=1e-4)


@cuda
def test_cuda_laps_prefill_worker_first_tokens_equal_enforce_eager(ckpt):
    """Protects the whole GPU path: a LAPS prefill worker with a captured (128, 4) graph gives the first tokens of the
    same worker with enforce_eager, and KV within float32 rounding."""
    kw = dict(device="cuda", dtype="float32", laps_graph_buckets=[(128, 4)], cuda_graph_sizes=(1,))
    graphed, buckets, replayed = _prefill(str(ckpt), "laps", graphed=False, **kw)
    eager, _, eager_replayed = _prefill(str(ckpt), "laps", graphed=False, enforce_eager=True, **kw)
    assert buckets == [(128, 4)] and replayed == 1 and eager_replayed == 0
    for rid in eager:
        assert graphed[rid][1] == eager[rid][1]
        torch.testing.assert_close(graphed[rid][0], eager[rid][0], atol=1e-4, rtol=1e-4)
