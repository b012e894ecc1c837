"""Engine sampling and stop handling: parameter validation, vLLM-like sampling, stops, streaming text."""
import math

import pytest
import torch

from tandem.engine.sampler import SampleOutput, Sampler, make_generator
from tandem.engine.sampling_params import SamplingParams, SamplingParamsError
from tandem.engine.stop import StopChecker

EOS = 256


# -- helpers ------------------------------------------------------------------------------------

def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable char map, so byte b is the BPE symbol with id b."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


@pytest.fixture(scope="module")
def byte_tok():
    """A real byte-level BPE tokenizer built offline: 256 byte tokens, no merges, <eos> = 256."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<eos>"])
    assert tok.token_to_id("<eos>") == EOS
    return tok


def _decode(tok):
    return lambda ids: tok.decode(ids, skip_special_tokens=True)


def _ids(tok, text: str) -> list[int]:
    ids = tok.encode(text).ids
    assert ids == list(text.encode("utf-8"))     # one token per byte
    return ids


def _run(checker: StopChecker, ids: list[int]) -> tuple[str | None, list[str]]:
    deltas = []
    reason = None
    for t in ids:
        reason = checker.append(t)
        deltas.append(checker.delta())
        if reason is not None:
            break
    return reason, deltas


# -- SamplingParams: validation ------------------------------------------------------------------

@pytest.mark.parametrize("field,value", [
    ("n", 2), ("n", 0),
    ("temperature", -0.1), ("temperature", math.inf), ("temperature", math.nan), ("temperature", "1"),
    ("top_p", 0.0), ("top_p", 1.5), ("top_p", -0.2), ("top_p", math.nan),
    ("top_k", -2), ("top_k", 2.5), ("top_k", True),
    ("min_p", -0.1), ("min_p", 1.1),
    ("max_tokens", 0), ("max_tokens", -3), ("max_tokens", 1.5),
    ("min_tokens", -1), ("min_tokens", 17),                    # > max_tokens (16)
    ("seed", 1.5), ("seed", "7"),
    ("stop", ""), ("stop", [""]), ("stop", ["ok", 3]), ("stop", 5),
    ("stop_token_ids", [1, -1]), ("stop_token_ids", [1.5]), ("stop_token_ids", 3),
    ("logprobs", -1), ("logprobs", 21),
    ("presence_penalty", 2.5), ("presence_penalty", -2.1),
    ("frequency_penalty", 3), ("frequency_penalty", -2.5),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", math.inf),
])
def test_invalid_param_raises_naming_field(field, value):
    """Protects request validation: each bad value is refused up front with the field named."""
    with pytest.raises(SamplingParamsError, match=field) as err:
        SamplingParams(**{field: value})
    assert isinstance(err.value, ValueError)


def test_params_normalise_defaults_and_clone():
    """Protects vLLM's defaults, stop/stop_token_ids normalisation, greedy, the temperature clamp."""
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens, p.min_tokens) == (1, 1.0, 1.0, 0, 0.0, 16, 0)
    assert p.stop == [] and p.stop_token_ids == [] and p.logprobs is None and not p.greedy
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(max_tokens=None, min_tokens=1000).max_tokens is None
    assert SamplingParams(temperature=0).greedy and SamplingParams(top_k=1).greedy
    assert not SamplingParams(top_k=-1).greedy
    assert SamplingParams(temperature=1e-4).temperature == pytest.approx(1e-2)
    q = SamplingParams(stop=["a"], stop_token_ids=[5])
    c = q.clone()
    c.stop.append("b")
    c.stop_token_ids.append(6)
    assert q.stop == ["a"] and q.stop_token_ids == [5] and c == SamplingParams(stop=["a", "b"], stop_token_ids=[5, 6])


# -- Sampler ---------------------------------------------------------------------------------------

def _logits(n=6, v=50, seed=0):
    return torch.randn(n, v, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_and_ties_take_lowest_id():
    """Protects greedy decoding: argmax per row, ties to the lowest id, whatever the generators."""
    x = _logits()
    x[0, 3] = x[0, 7] = x[0].max() + 1
    out = Sampler(seed=0).sample(x, [SamplingParams(temperature=0)] * 6, [None] * 6)
    assert isinstance(out, SampleOutput)
    assert out.token_ids == x.argmax(-1).tolist() and out.token_ids[0] == 3
    assert out.logprobs is None and out.top_logprobs is None


def test_top_k_1_and_tiny_top_p_equal_greedy():
    """Protects top-k / top-p masking: k=1 and a tiny nucleus both leave only the argmax."""
    x = _logits(n=64, v=100, seed=1)
    s = Sampler(seed=3)
    arg = x.argmax(-1).tolist()
    assert s.sample(x, [SamplingParams(top_k=1, temperature=1.5)] * 64, [None] * 64).token_ids == arg
    assert s.sample(x, [SamplingParams(top_p=1e-6, temperature=2.0)] * 64, [None] * 64).token_ids == arg
    assert s.sample(x, [SamplingParams(top_p=1e-6, top_k=5, min_p=0.01)] * 64, [None] * 64).token_ids == arg


def test_mixed_greedy_and_random_rows():
    """Protects batch assembly: greedy rows stay argmax beside random rows."""
    x = _logits(n=8, v=40, seed=2)
    params = [SamplingParams(temperature=0) if i % 2 else SamplingParams(temperature=1.0) for i in range(8)]
    out = Sampler(seed=0).sample(x, params, [make_generator(i, "cpu") for i in range(8)])
    assert [out.token_ids[i] for i in range(1, 8, 2)] == x[1::2].argmax(-1).tolist()


def test_seeded_sampling_reproducible_and_batch_independent():
    """Protects seeded requests: same tokens alone or in any batch, as long as its generator is kept."""
    v = 200
    steps = [torch.randn(v, generator=torch.Generator().manual_seed(100 + t)) for t in range(12)]
    p = SamplingParams(temperature=1.3, top_p=0.95, top_k=50, seed=1234)

    def run(batch_builder):
        g = make_generator(p.seed, "cpu")
        s = Sampler()       # unseeded default generator: other rows differ run to run
        toks = []
        for t, row in enumerate(steps):
            others, ogens = batch_builder(t)
            x = torch.stack([*[torch.randn(v) for _ in others], row, torch.randn(v)])
            out = s.sample(x, [*others, p, SamplingParams(temperature=0.7)], [*ogens, g, None])
            toks.append(out.token_ids[len(others)])
        return toks

    alone = run(lambda t: ([], []))
    crowd = run(lambda t: ([SamplingParams(temperature=0.5, min_p=0.1)] * (t % 4)
                           + [SamplingParams(temperature=0)],
                           [make_generator(t, "cpu")] * (t % 4) + [None]))
    assert alone == crowd
    assert len(set(alone)) > 1        # really random, not argmax
    assert make_generator(None, "cpu") is None


def test_sampling_frequencies_match_probabilities():
    """Protects unbiased temperature-1 sampling (exponential race): chi-square vs the true probs."""
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.0])
    n = 20000
    x = probs.log().expand(n, -1).clone()
    for gens in ([None] * n, [make_generator(i, "cpu") for i in range(n)]):
        out = Sampler(seed=0).sample(x, [SamplingParams()] * n, gens)
        counts = torch.bincount(torch.tensor(out.token_ids), minlength=5).double()
        assert counts[4] == 0
        exp = probs[:4].double() * n
        chi2 = float(((counts[:4] - exp) ** 2 / exp).sum())
        assert chi2 < 16.27              # 3 dof, p = 0.001


def test_temperature_flattens_and_sharpens():
    """Protects temperature scaling: a high temperature spreads the draws, a low one concentrates them."""
    x = torch.tensor([2.0, 1.0, 0.0]).expand(4000, -1).clone()
    s = Sampler(seed=5)
    hot = s.sample(x, [SamplingParams(temperature=5.0)] * 4000, [None] * 4000).token_ids
    cold = s.sample(x, [SamplingParams(temperature=0.2)] * 4000, [None] * 4000).token_ids
    assert hot.count(0) / 4000 < 0.5 < cold.count(0) / 4000


def test_top_k_2_stays_in_top_2():
    """Protects top-k: no draw outside the k best tokens, and both of them are drawn."""
    x = _logits(n=1, v=30, seed=4).expand(3000, -1).clone()
    top2 = set(x[0].topk(2).indices.tolist())
    toks = Sampler(seed=1).sample(x, [SamplingParams(top_k=2, temperature=3.0)] * 3000, [None] * 3000).token_ids
    assert set(toks) == top2


def test_top_p_keeps_smallest_nucleus():
    """Protects top-p: with p=0.55 over [0.5, 0.3, 0.15, 0.05] only the two best tokens survive."""
    x = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().expand(3000, -1).clone()
    toks = Sampler(seed=1).sample(x, [SamplingParams(top_p=0.55)] * 3000, [None] * 3000).token_ids
    assert set(toks) == {0, 1}


def test_min_p_filters():
    """Protects min-p: tokens below min_p x the top probability are never drawn."""
    x = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().expand(3000, -1).clone()
    s = Sampler(seed=2)
    toks = s.sample(x, [SamplingParams(min_p=0.2)] * 3000, [None] * 3000).token_ids   # threshold 0.1
    assert set(toks) == {0, 1, 2}
    toks = s.sample(x, [SamplingParams(min_p=0.5)] * 3000, [None] * 3000).token_ids   # threshold 0.25
    assert set(toks) == {0, 1}


def test_penalties_change_argmax_as_vllm():
    """Protects vLLM's penalty formulas (repetition divides positive / multiplies negative logits)."""
    s = Sampler()
    g = SamplingParams(temperature=0, repetition_penalty=1.2)
    x = torch.tensor([[2.0, 1.9, -1.0], [-1.0, -1.1, -5.0], [2.0, 1.9, -1.0]])
    out = s.sample(x, [g, g, SamplingParams(temperature=0)], [None] * 3, output_tokens=[[0], [0], [0]])
    assert out.token_ids == [1, 1, 0]         # 2/1.2 < 1.9; -1*1.2 < -1.1; no penalty: unchanged
    # the repetition penalty also counts prompt tokens
    assert s.sample(x[:1], [g], [None], output_tokens=[[]], prompt_tokens=[[0]]).token_ids == [1]
    x = torch.tensor([[1.0, 0.8, 0.0]])
    assert s.sample(x, [SamplingParams(temperature=0, frequency_penalty=0.15)], [None],
                    output_tokens=[[0, 0]]).token_ids == [1]        # 1 - 2*0.15 = 0.7 < 0.8
    assert s.sample(x, [SamplingParams(temperature=0, frequency_penalty=0.15)], [None],
                    output_tokens=[[0]]).token_ids == [0]           # 0.85 > 0.8
    assert s.sample(x, [SamplingParams(temperature=0, presence_penalty=0.5)], [None],
                    output_tokens=[[0, 0, 0]]).token_ids == [1]     # presence counts once: 0.5 < 0.8
    assert s.sample(x, [SamplingParams(temperature=0, presence_penalty=0.5)], [None]).token_ids == [0]


def test_min_tokens_masks_eos_and_stop_ids_in_sampler():
    """Protects min_tokens in the sampler: EOS / stop ids cannot be drawn before min_tokens outputs."""
    s = Sampler(eos_token_ids=[2])
    x = torch.tensor([[0.0, 1.0, 5.0, 4.0]])
    p = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[1])
    assert s.sample(x, [p], [None], output_tokens=[[0]]).token_ids == [3]
    assert s.sample(x, [p], [None], output_tokens=[[0, 0]]).token_ids == [2]
    assert s.sample(x, [SamplingParams(temperature=0, min_tokens=2, ignore_eos=True)], [None],
                    output_tokens=[[0]]).token_ids == [2]


def test_logprobs_are_raw_log_softmax():
    """Protects logprobs: the chosen token's raw (unprocessed) log_softmax and exactly k top entries."""
    x = _logits(n=5, v=60, seed=7)
    params = [SamplingParams(temperature=0.7, top_k=10, logprobs=3, repetition_penalty=1.3),
              SamplingParams(temperature=0, logprobs=0),
              SamplingParams(logprobs=5),
              SamplingParams(),
              SamplingParams(temperature=0, logprobs=20)]
    out = Sampler(seed=0).sample(x, params, [None] * 5, output_tokens=[[1, 2]] * 5)
    raw = torch.log_softmax(x, -1)
    for i, t in enumerate(out.token_ids):
        assert out.logprobs[i] == pytest.approx(raw[i, t].item(), abs=1e-5)
    assert [len(d) for d in out.top_logprobs] == [3, 0, 5, 0, 20]
    vals, idx = raw[2].topk(5)
    assert out.top_logprobs[2] == pytest.approx(dict(zip(idx.tolist(), vals.tolist())))
    assert Sampler().sample(x, [SamplingParams(logprobs=0)] * 5, [None] * 5).top_logprobs is None


# -- logit_bias ----------------------------------------------------------------------------------

def test_logit_bias_plus_100_forces_the_token_greedy_and_sampled():
    """Protects logit_bias: +100 on a token makes it the argmax and (at temperature 1) the only likely draw."""
    x = _logits(n=16, v=50, seed=11)
    low = x.argmin(-1)[0].item()
    forced = SamplingParams(temperature=0, logit_bias={low: 100})
    sampled = SamplingParams(temperature=1.0, logit_bias={low: 100})
    s = Sampler(seed=0)
    assert s.sample(x[:1], [forced], [None]).token_ids == [low]
    assert s.sample(x[:1].expand(16, -1), [sampled] * 16, [make_generator(i, "cpu") for i in range(16)]
                    ).token_ids == [low] * 16


def test_logit_bias_minus_100_on_the_argmax_changes_the_greedy_token():
    """Protects logit_bias with negative values: -100 on the argmax leaves the second best as the greedy token."""
    x = _logits(n=1, v=50, seed=12)
    top2 = x[0].topk(2).indices.tolist()
    out = Sampler().sample(x, [SamplingParams(temperature=0, logit_bias={top2[0]: -100})], [None])
    assert out.token_ids == [top2[1]]


def test_logit_bias_applies_per_row_and_logprobs_stay_raw():
    """Protects the batched scatter-add: only rows with a bias change (greedy and random rows mixed); the
    returned logprobs are the raw model's, as vLLM's default raw_logprobs."""
    x = _logits(n=4, v=30, seed=13)
    params = [SamplingParams(temperature=0, logit_bias={5: 100, 6: -3.5}, logprobs=0),
              SamplingParams(temperature=0, logprobs=0),
              SamplingParams(temperature=1.0, top_k=3, logit_bias={29: 100}),
              SamplingParams(temperature=0, logit_bias={0: 100, 1: 100.0})]
    x[3, 1] = x[3, 0] + 1.0                                    # both +100: the larger raw logit wins
    out = Sampler(seed=0).sample(x, params, [None] * 4)
    assert out.token_ids == [5, x[1].argmax().item(), 29, 1]
    raw = torch.log_softmax(x, -1)
    assert out.logprobs[0] == pytest.approx(raw[0, 5].item(), abs=1e-6)


def test_logit_bias_outside_the_logits_is_an_error():
    """Protects the sampler's guard: a bias on an id >= the vocabulary never indexes out of bounds silently."""
    with pytest.raises(ValueError, match="outside the vocabulary"):
        Sampler().sample(_logits(n=1, v=30), [SamplingParams(temperature=0, logit_bias={30: 1.0})], [None])


@pytest.mark.parametrize("bias,why", [
    ({"5": 1.0}, "keys must be token ids"), ({-1: 1.0}, "keys must be token ids"), ({1.5: 1.0}, "keys must"),
    ({True: 1.0}, "keys must"), ({1 << 40: 1.0}, "keys must"),
    ({5: 100.5}, "values must be numbers in \\[-100, 100\\]"), ({5: -101}, "values must"),
    ({5: math.inf}, "values must"), ({5: math.nan}, "values must"), ({5: "1"}, "values must"),
    ([(5, 1.0)], "must be None or a dict"), ({i: 1.0 for i in range(1025)}, "at most 1024 entries, got 1025"),
])
def test_invalid_logit_bias_is_refused_with_a_short_message(bias, why):
    """Protects logit_bias validation: int ids >= 0, finite biases in [-100, 100], at most 1024 entries (vLLM's cap)."""
    with pytest.raises(SamplingParamsError, match=why) as err:
        SamplingParams(logit_bias=bias)
    assert str(err.value).startswith("logit_bias") and len(str(err.value)) < 300


def test_logit_bias_is_normalised_and_a_huge_key_is_not_echoed():
    """Protects normalisation (int -> float values, {} -> None) and shorten() on a huge bad key."""
    assert SamplingParams(logit_bias={3: 5, 4: -100}).logit_bias == {3: 5.0, 4: -100.0}
    assert SamplingParams(logit_bias={}).logit_bias is None
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(logit_bias={"k" * 1_000_000: 1.0})
    assert len(str(err.value)) < 300
    with pytest.raises(SamplingParamsError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)


# -- StopChecker ---------------------------------------------------------------------------------

def test_eos_stops_and_is_kept_in_ids_not_text(byte_tok):
    """Protects EOS handling: finish "stop", stop_reason None, EOS id in token_ids but not in text."""
    c = StopChecker(SamplingParams(max_tokens=100), [EOS], _decode(byte_tok))
    reason, _ = _run(c, _ids(byte_tok, "hi there") + [EOS, 65])
    assert reason == "stop" and c.finish_reason == "stop" and c.stop_reason is None
    assert c.text == "hi there" and c.token_ids == _ids(byte_tok, "hi there") + [EOS]
    with pytest.raises(RuntimeError):
        c.append(65)


def test_ignore_eos_continues(byte_tok):
    """Protects ignore_eos: EOS is an ordinary token, generation runs to max_tokens."""
    c = StopChecker(SamplingParams(max_tokens=5, ignore_eos=True), [EOS], _decode(byte_tok))
    reason, _ = _run(c, [104, EOS, 105, EOS, 106, 107])
    assert reason == "length" and c.token_ids == [104, EOS, 105, EOS, 106] and c.text == "hij"


def test_stop_string_spanning_tokens_truncates(byte_tok):
    """Protects stop strings: matched across tokens, text cut before it, stop_reason is the string."""
    p = SamplingParams(max_tokens=100, stop=["zzz", "END"])
    c = StopChecker(p, [EOS], _decode(byte_tok))
    reason, deltas = _run(c, _ids(byte_tok, "abc ENxD then END and more"))
    assert reason == "stop" and c.stop_reason == "END" and c.text == "abc ENxD then "
    assert "".join(deltas) == c.text              # nothing emitted that was later cut
    assert c.token_ids == _ids(byte_tok, "abc ENxD then END")


def test_stop_string_inside_a_multi_char_token():
    """Protects truncation when one token carries text past the stop string; earliest match wins."""
    vocab = ["Hel", "lo wor", "ld! STOP", " tail", "xSTxOPx"]
    dec = lambda ids: "".join(vocab[i] for i in ids)  # noqa: E731
    c = StopChecker(SamplingParams(stop=["! ST", "STOP"]), [], dec)
    assert _run(c, [0, 1, 2, 3]) == ("stop", ["", "Hello ", "world"])   # "Hello wor" less 3 held back
    assert c.text == "Hello world" and c.stop_reason == "! ST"
    c = StopChecker(SamplingParams(stop=["STOP", "! ST"], include_stop_str_in_output=True), [], dec)
    reason, deltas = _run(c, [0, 1, 2, 3])
    assert reason == "stop" and c.text == "Hello world! ST" and "".join(deltas) == c.text


def test_include_stop_str_in_output_keeps_it(byte_tok):
    """Protects include_stop_str_in_output: the text ends with the stop string."""
    p = SamplingParams(max_tokens=100, stop="END", include_stop_str_in_output=True)
    c = StopChecker(p, [EOS], _decode(byte_tok))
    reason, deltas = _run(c, _ids(byte_tok, "abc END and more"))
    assert reason == "stop" and c.text == "abc END" and c.stop_reason == "END"
    assert "".join(deltas) == "abc END"


def test_max_tokens_gives_length(byte_tok):
    """Protects max_tokens: "length" after exactly max_tokens tokens, stop_reason None."""
    c = StopChecker(SamplingParams(max_tokens=3), [EOS], _decode(byte_tok))
    reason, deltas = _run(c, _ids(byte_tok, "abcdef"))
    assert reason == "length" and c.text == "abc" and c.stop_reason is None and len(c.token_ids) == 3
    assert "".join(deltas) == "abc"


def test_min_tokens_suppresses_early_stops(byte_tok):
    """Protects min_tokens: EOS, stop ids and stop strings within the first min_tokens are ignored."""
    c = StopChecker(SamplingParams(min_tokens=3, max_tokens=100, stop_token_ids=[33], stop="b"),
                    [EOS], _decode(byte_tok))
    assert c.append(EOS) is None and c.append(33) is None and c.append(98) is None
    assert c.append(EOS) == "stop" and c.token_ids == [EOS, 33, 98, EOS] and c.text == "!b"


def test_stop_token_ids(byte_tok):
    """Protects stop_token_ids: finish "stop", stop_reason the id, id kept in ids; text only if asked."""
    c = StopChecker(SamplingParams(stop_token_ids=[ord("\n")]), [EOS], _decode(byte_tok))
    reason, _ = _run(c, _ids(byte_tok, "line one\nline two"))
    assert reason == "stop" and c.stop_reason == ord("\n") and c.text == "line one"
    assert c.token_ids[-1] == ord("\n")
    c = StopChecker(SamplingParams(stop_token_ids=[10], include_stop_str_in_output=True), [EOS], _decode(byte_tok))
    _run(c, _ids(byte_tok, "line one\nline two"))
    assert c.text == "line one\n"


TEXT = "héllo wörld — 你好, 🎉 naïve café €5 😀!"


def test_incremental_utf8_matches_full_decode(byte_tok):
    """Protects incremental detokenisation: multi-byte chars split over byte tokens never leak U+FFFD."""
    ids = _ids(byte_tok, TEXT)
    c = StopChecker(SamplingParams(max_tokens=None, stop=["<<never>>"]), [EOS], _decode(byte_tok),
                    prompt_token_ids=_ids(byte_tok, "prompt 你"))
    deltas = []
    for i, t in enumerate(ids):
        assert c.append(t) is None
        assert "\ufffd" not in c.text and TEXT.startswith(c.text)
        if i + 1 < len(ids) and (ids[i + 1] & 0xC0) != 0x80:      # next byte starts a char
            assert c.text == byte_tok.decode(ids[:i + 1])
        d = c.delta()
        assert "\ufffd" not in d
        deltas.append(d)
    assert c.append(EOS) == "stop"
    deltas.append(c.delta())
    assert c.text == TEXT == byte_tok.decode(ids) and "".join(deltas) == TEXT
    assert all("\ufffd" not in d for d in deltas)


def test_stop_string_with_multibyte_chars(byte_tok):
    """Protects stop strings over multi-byte UTF-8: cut at the character, streamed text consistent."""
    c = StopChecker(SamplingParams(max_tokens=None, stop="你好"), [EOS], _decode(byte_tok))
    reason, deltas = _run(c, _ids(byte_tok, TEXT))
    assert reason == "stop" and c.text == "héllo wörld — " and "".join(deltas) == c.text
    assert all("\ufffd" not in d for d in deltas)


def test_length_mid_character_flushes_like_decode(byte_tok):
    """Protects the documented flush: a request cut mid-character ends with U+FFFD, as decode does."""
    ids = _ids(byte_tok, "a你")
    c = StopChecker(SamplingParams(max_tokens=2), [EOS], _decode(byte_tok))
    assert c.append(ids[0]) is None and c.delta() == "a"
    assert c.append(ids[1]) == "length"
    assert c.text == byte_tok.decode(ids[:2]) == "a\ufffd" and c.delta() == "\ufffd"


def test_finish_from_outside_and_delta_holdback(byte_tok):
    """Protects finish() (context limit / abort) and the stop-prefix holdback of delta()."""
    c = StopChecker(SamplingParams(max_tokens=None, stop=["ENDX"]), [EOS], _decode(byte_tok))
    for t in _ids(byte_tok, "abcdEND"):
        c.append(t)
    assert c.delta() == "abcd"                   # "END" may still become "ENDX"
    c.finish("length")
    assert c.finish_reason == "length" and c.delta() == "END" and c.text == "abcdEND"
