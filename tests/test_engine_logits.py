"""Logit decomposition (max_num_logits, tandem/engine/logits.py): the LM head and the sampler on at most N rows at a
time give exactly the monolithic outputs, for every decoding strategy, in the sampler and through the engine."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tandem.cli.main import main  # noqa: E402
from tandem.engine.config import EngineConfig, EngineError  # noqa: E402
from tandem.engine.llm import LLM  # noqa: E402
from tandem.engine.logits import (  # noqa: E402
    decode_confidence, iter_logit_chunks, logit_chunks, reduce_logits, target_logprobs, token_confidence,
)
from tandem.engine.models.layers import Linear  # noqa: E402
from tandem.engine.sampler import Sampler, make_generator  # noqa: E402
from tandem.engine.sampling_params import SamplingParams  # noqa: E402
from tandem.engine.structured_output import StructuredOutput  # noqa: E402
from tandem.engine.tiny_model import make_tiny_model  # noqa: E402


pytestmark = pytest.mark.usefixtures("one_thread")     # tests/conftest.py


@pytest.fixture(scope="module")
def head():
    """A 64 -> 3000 LM head (the engine's Linear: oneDNN on CPU) and 37 random hidden rows."""
    torch.manual_seed(0)
    lin = Linear(64, 3000, bias=False)
    with torch.no_grad():
        lin.weight.mul_(8.0)                          # logits of a few units: sampling is not uniform
    return lin, torch.randn(37, 64)


def _compute(lin):
    def f(h):
        with torch.inference_mode():
            return lin(h).float()
    return f


def test_logit_chunks_cover_the_rows_in_order_and_reject_bad_caps():
    """Protects the chunking every reducer relies on: consecutive, in order, at most max_rows, None = one chunk."""
    assert logit_chunks(10, 3) == [slice(0, 3), slice(3, 6), slice(6, 9), slice(9, 10)]
    assert logit_chunks(10, None) == [slice(0, 10)]
    assert logit_chunks(10, 10) == logit_chunks(10, 64) == [slice(0, 10)]
    assert logit_chunks(0, 4) == []
    for bad in (0, -1, True, 2.5, "4"):
        with pytest.raises(ValueError, match="max_num_logits"):
            logit_chunks(5, bad)
    h = torch.arange(12.0).view(6, 2)
    got = [(rows, t.tolist()) for rows, t in iter_logit_chunks(h, 4)]
    assert got == [(slice(0, 4), h[:4].tolist()), (slice(4, 6), h[4:].tolist())]


def test_reduce_logits_projects_at_most_max_rows_at_once(head):
    """Protects the memory bound: the LM head never sees more than max_rows rows, the reductions come in row order."""
    lin, hidden = head
    seen: list[int] = []

    def compute(h):
        seen.append(h.shape[0])
        return _compute(lin)(h)
    out = reduce_logits(compute, hidden, 8, lambda rows, logits: (rows.start, logits.shape[0]))
    assert seen == [8, 8, 8, 8, 5]
    assert out == [(0, 8), (8, 8), (16, 8), (24, 8), (32, 5)]


def test_the_lm_head_gives_each_row_the_same_bits_whatever_the_chunk(head):
    """Protects the premise of exact decomposition on CPU: the oneDNN linear is row-invariant (MKL's sgemm is not)."""
    lin, hidden = head
    full = _compute(lin)(hidden)
    for step in (1, 3, 8, 36):
        assert torch.equal(torch.cat([_compute(lin)(h) for _, h in iter_logit_chunks(hidden, step)]), full)


def test_cpu_generator_draws_do_not_depend_on_how_rows_are_split():
    """Protects unseeded rows under decomposition: on CPU, noise drawn as [a, V] then [b, V] equals one [a + b, V]."""
    g = torch.Generator().manual_seed(7)
    whole = torch.empty(9, 3000).exponential_(generator=g)
    g = torch.Generator().manual_seed(7)
    parts = torch.cat([torch.empty(n, 3000).exponential_(generator=g) for n in (4, 1, 4)])
    assert torch.equal(whole, parts)


def test_decode_confidence_is_the_argmax_and_its_probability_for_every_chunking(head):
    """Protects the diffusion decoder's reducer: (argmax, softmax max) per row, bit-identical across chunkings."""
    lin, hidden = head
    logits = _compute(lin)(hidden)
    tok, conf = decode_confidence(_compute(lin), hidden, None)
    assert torch.equal(tok, logits.argmax(dim=-1))
    assert torch.allclose(conf, torch.softmax(logits, dim=-1).max(dim=-1).values, rtol=1e-6, atol=0)
    for step in (1, 5, 16):
        t2, c2 = decode_confidence(_compute(lin), hidden, step)
        assert torch.equal(t2, tok) and torch.equal(c2, conf)
    t1, c1 = token_confidence(torch.tensor([[0.0, 2.0, 2.0]]))      # ties to the lowest id
    assert t1.tolist() == [1] and c1.item() == pytest.approx(torch.softmax(torch.tensor([0.0, 2, 2]), 0)[1].item())
    e_tok, e_conf = decode_confidence(_compute(lin), hidden[:0], 4)
    assert e_tok.shape == (0,) and e_conf.shape == (0,)


def test_target_logprobs_equal_the_full_log_softmax_for_every_chunking(head):
    """Protects prompt logprobs: each row's target logprob and its own top k, identical for 1, 7 or all rows at once."""
    lin, hidden = head
    lp = torch.log_softmax(_compute(lin)(hidden), dim=-1)
    targets = [(i * 37) % 3000 for i in range(37)]
    ks = [i % 4 for i in range(37)]                   # 0..3 per row
    ref = target_logprobs(_compute(lin), hidden, targets, ks, None)
    for i, entry in enumerate(ref):
        top = lp[i].topk(ks[i]).indices.tolist() if ks[i] else []
        assert set(entry) == {targets[i], *top}
        assert entry[targets[i]] == lp[i, targets[i]].item()
    for step in (1, 7):
        assert target_logprobs(_compute(lin), hidden, targets, ks, step) == ref
    with pytest.raises(ValueError, match="one target and one k per row"):
        target_logprobs(_compute(lin), hidden, targets[:3], ks, 4)


def _mixed_rows(n: int, vocab: int):
    """Per row: params covering every sampler mode, a seeded generator where the mode wants one, token histories."""
    modes = [
        dict(temperature=0.0),                                                 # greedy
        dict(temperature=0.8, top_k=20, top_p=0.9, seed=11),                   # seeded top-k / top-p
        dict(temperature=1.2, min_p=0.05, seed=12),                            # seeded min-p
        dict(temperature=1.0),                                                 # unseeded: the default generator
        dict(temperature=0.7, top_p=0.5),                                      # unseeded top-p
        dict(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.4),   # penalties
        dict(temperature=0.9, repetition_penalty=0.8, presence_penalty=-0.3, seed=13),
        dict(temperature=0.0, logit_bias={5: 100.0, 9: -50.0}),                # logit bias
        dict(temperature=1.0, min_tokens=4, stop_token_ids=[3], seed=14),      # min_tokens masks EOS/stop ids
        dict(temperature=0.0, logprobs=5),
        dict(temperature=1.0, top_k=1, logprobs=0),                            # top_k 1 = greedy
        dict(temperature=0.6, logprobs=20, seed=15),
    ]
    params, seeds, outs, prompts = [], [], [], []
    for i in range(n):
        p = SamplingParams(**modes[i % len(modes)])
        params.append(p)
        seeds.append(p.seed)
        outs.append([(i * 7 + j) % vocab for j in range(i % 5)])
        prompts.append([(i * 13 + j) % vocab for j in range(3 + i % 4)])
    return params, seeds, outs, prompts


@pytest.mark.parametrize("max_rows", [1, 5, 16, 36])
def test_sampler_decomposed_equals_monolithic_for_every_mode(head, max_rows):
    """Protects logit decomposition in the sampler: greedy, seeded and unseeded sampling, top-k/p, min-p, penalties,
    logit_bias, min_tokens and logprobs give the same tokens, logprobs and top logprobs in chunks of max_rows."""
    lin, hidden = head
    params, seeds, outs, prompts = _mixed_rows(hidden.shape[0], 3000)

    def run(chunked: bool):
        s = Sampler(eos_token_ids=[2], seed=0)
        gens = [make_generator(sd, "cpu") for sd in seeds]
        if chunked:
            return s.sample_hidden(hidden, _compute(lin), params, gens, outs, prompts, max_rows=max_rows)
        return s.sample(_compute(lin)(hidden), params, gens, outs, prompts)

    ref, got = run(False), run(True)
    assert got.token_ids == ref.token_ids
    assert got.logprobs == ref.logprobs and got.top_logprobs == ref.top_logprobs
    assert [len(d) for d in got.top_logprobs[9:12]] == [5, 0, 20]
    assert ref.token_ids[7] == 5                      # the +100 bias wins
    assert len(set(ref.token_ids)) > 10               # rows are sampled, not one token everywhere


def test_sample_hidden_validates_its_inputs(head):
    """Protects the sampler's contract: one params entry (and generator) per hidden row, a valid cap."""
    lin, hidden = head
    s = Sampler()
    with pytest.raises(ValueError, match="hidden must be"):
        s.sample_hidden(hidden, _compute(lin), [SamplingParams()] * 3)
    with pytest.raises(ValueError, match="one generator"):
        s.sample_hidden(hidden[:2], _compute(lin), [SamplingParams()] * 2, [None])
    with pytest.raises(ValueError, match="max_num_logits"):
        s.sample_hidden(hidden[:2], _compute(lin), [SamplingParams()] * 2, max_rows=0)
    assert s.sample_hidden(hidden[:0], _compute(lin), []).token_ids == []


# --------------------------------------------------------------------------- through the engine
@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-logits")
    make_tiny_model(path, arch="qwen3", size="1m", seed=3)
    return str(path)


def _engine_requests(structured: bool):
    """Eight requests, one per decoding strategy; prompts long enough for chunked prefill (32-token steps)."""
    ps = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
          SamplingParams(temperature=0.9, top_k=40, top_p=0.9, seed=5, max_tokens=12, ignore_eos=True),
          SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True),                 # engine's default gen
          SamplingParams(temperature=0.7, repetition_penalty=1.4, frequency_penalty=0.6, presence_penalty=0.3,
                         seed=6, max_tokens=12, ignore_eos=True),
          SamplingParams(temperature=0.0, logit_bias={40: 5.0, 41: -100.0}, min_tokens=6, max_tokens=12),
          SamplingParams(temperature=0.8, logprobs=4, seed=7, max_tokens=12, ignore_eos=True),
          SamplingParams(temperature=0.0, prompt_logprobs=3, logprobs=2, max_tokens=6, ignore_eos=True)]
    if structured:
        ps.append(SamplingParams(temperature=1.0, seed=8, max_tokens=24, structured_output=StructuredOutput.json_object()))
    prompts = [[(17 * i + j) % 400 + 1 for j in range(10 + 9 * i)] for i in range(len(ps))]
    return prompts, ps


def test_engine_outputs_identical_with_and_without_max_num_logits(tiny):
    """Protects token-for-token equality: logprobs, top logprobs and prompt logprobs (chunked over prefill
    steps) equal the monolithic engine's with the LM head on 1 or 3 rows at a time; structured output too when
    xgrammar is installed."""
    structured = True
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        structured = False
    prompts, params = _engine_requests(structured)
    results = {}
    for cap in (None, 1, 3):
        llm = LLM(tiny, max_num_logits=cap, max_num_batched_tokens=32, num_kv_blocks=64, max_model_len=256)
        assert llm.engine.runner.max_num_logits == cap
        assert llm.engine.runner.prompt_logit_rows == (cap or (1 << 22) // llm.engine.model_config.vocab_size)
        outs = llm.generate(prompts, [p.clone() for p in params])
        results[cap] = [(o.token_ids, o.outputs[0].logprobs, o.outputs[0].cumulative_logprob, o.prompt_logprobs,
                         o.outputs[0].finish_reason) for o in outs]
    assert results[1] == results[None] and results[3] == results[None]
    ref = results[None]
    assert all(len(r[0]) >= 6 for r in ref)
    assert ref[4][0][:6].count(41) == 0 and len(ref[6][3]) == len(prompts[6])     # bias -100; every prompt position
    assert all(len(e) == 1 + 3 or len(e) == 3 for e in ref[6][3][1:])            # target + top 3 (target may be in it)


def test_max_num_logits_is_validated_in_the_config_and_the_cli(tiny, tmp_path, capsys):
    """Protects input validation: an integer >= 1 in EngineConfig; `tandem serve --max-num-logits` one-line errors
    (exit 2) and the flag reaching every worker's engine arguments."""
    for bad in (0, -3, True, 2.5, "8"):
        with pytest.raises(EngineError, match="max_num_logits must be an integer >= 1"):
            EngineConfig(model=tiny, max_num_logits=bad)
    assert EngineConfig(model=tiny, max_num_logits=7).max_num_logits == 7
    for value, needle in (("0", "must be >= 1"), ("x", "expected an integer")):
        rc = main(["serve", "--model", str(tmp_path), "--max-num-logits", value])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1 and err[0].startswith("tandem: error: ")
        assert "--max-num-logits" in err[0] and needle in err[0]
    from tandem.cli import serve_cmd
    from tandem.cli.common import Parser
    p = Parser(prog="tandem")
    serve_cmd.add_parser(p.add_subparsers())
    eng = serve_cmd._cluster_config(p.parse_args(["serve", "--model", tiny, "--max-num-logits", "64"])).engine_args
    assert eng["max_num_logits"] == 64 and EngineConfig(model=tiny, **eng).max_num_logits == 64
    assert "max_num_logits" not in serve_cmd._cluster_config(p.parse_args(["serve", "--model", tiny])).engine_args
