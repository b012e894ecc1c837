"""The CPU paged decode and prefill kernels (engine/attention/native.py) against the gather + SDPA paths they
replace: same outputs on awkward batches, the engine's greedy tokens unchanged, and a clean fallback when the
kernels cannot be built or are turned off."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tandem.engine.attention import native  # noqa: E402
from tandem.engine.attention.metadata import AttnMetadata, allocate_kv_cache  # noqa: E402
from tandem.engine.attention.sdpa import SdpaBackend  # noqa: E402

pytestmark = pytest.mark.skipif(native.load() is None, reason=f"kernel unavailable: {native.unavailable_reason()}")


@pytest.fixture
def sdpa_only(monkeypatch):
    """Route decode through the gather + SDPA path for the duration of a call (as TANDEM_CPU_ATTENTION=sdpa)."""
    def off():
        monkeypatch.setattr(native, "supports", lambda q, kv: False)
    return off


def _attend(qlens, lens, hq, hkv, d, bs, seed, reverse_tables=False):
    """(q, k, v, kv cache, metadata factory) for one step of sequences with these query and KV lengths."""
    g = torch.Generator().manual_seed(seed)
    tables, nxt = [], 1
    for L in lens:
        k = -(-L // bs)
        ids = list(range(nxt, nxt + k))
        tables.append(ids[::-1] if reverse_tables else ids)
        nxt += k
    kv = allocate_kv_cache(1, nxt + 1, bs, hkv, d, torch.float32, "cpu")[0]
    kv.normal_(generator=g)
    T = sum(qlens)
    q, k, v = (torch.randn(T, h, d, generator=g) for h in (hq, hkv, hkv))
    return q, k, v, kv, lambda: AttnMetadata.build(qlens, lens, tables, bs, "cpu")


@pytest.mark.parametrize("qlens,lens,hq,hkv,d,bs", [
    ([1] * 6, [1, 2, 15, 16, 17, 300], 8, 4, 64, 16),           # partial, exact and multi-block sequences (GQA 2)
    ([1, 9, 1, 1, 30, 1], [40, 9, 1, 77, 130, 33], 4, 4, 32, 16),  # decodes between prefills (no GQA)
    ([1, 1, 1], [5, 64, 129], 16, 2, 128, 32),                  # GQA 8, head dim 128, blocks of 32
    ([1, 1], [3, 200], 6, 2, 40, 16),                           # GQA 3, head dim 40: 8 lanes past a 16-float chunk
])
def test_kernel_matches_the_gather_sdpa_path(qlens, lens, hq, hkv, d, bs, sdpa_only):
    """Protects decode attention numerics: every query row (decode and prefill alike) equals the SDPA path to
    float32 rounding, with block tables in any order and decodes interleaved with prefills."""
    q, k, v, kv, meta = _attend(qlens, lens, hq, hkv, d, bs, seed=len(lens), reverse_tables=True)
    be = SdpaBackend()
    got = be.forward(q, k, v, kv.clone(), meta(), d ** -0.5)
    sdpa_only()
    want = SdpaBackend().forward(q, k, v, kv.clone(), meta(), d ** -0.5)
    assert got.shape == want.shape
    assert torch.allclose(got, want, atol=2e-6, rtol=1e-5), (got - want).abs().max()


@pytest.mark.parametrize("qlens,lens,hq,hkv,d,bs", [
    ([256], [256], 8, 4, 64, 16),                               # a whole prompt: 16 tiles of 16 positions x 2 heads
    ([2, 100, 37, 5], [2, 300, 100, 5], 4, 4, 64, 16),          # no GQA: tiles of 32 positions; cached prefixes
    ([33, 1, 17], [64, 90, 17], 6, 2, 48, 32),                  # GQA 3 (tiles of 10 positions, 2 padding lanes)
    ([40, 7], [129, 7], 16, 2, 128, 16),                        # GQA 8, head dim 128
    ([3, 1], [40, 12], 32, 1, 32, 16),                          # GQA 32: one position per tile
])
def test_prefill_kernel_matches_sdpa(qlens, lens, hq, hkv, d, bs, sdpa_only):
    """Protects prefill attention numerics: every chunk's rows (fresh prompts, chunks after a cached prefix, tiles
    cut mid-chunk and padded, block tables in reverse order) equal causal SDPA to float32 rounding."""
    q, k, v, kv, meta = _attend(qlens, lens, hq, hkv, d, bs, seed=sum(lens), reverse_tables=True)
    assert native.supports_prefill(q, kv)
    got = SdpaBackend().forward(q, k, v, kv.clone(), meta(), d ** -0.5)
    sdpa_only()
    want = SdpaBackend().forward(q, k, v, kv.clone(), meta(), d ** -0.5)
    assert torch.allclose(got, want, atol=2e-6, rtol=1e-5), (got - want).abs().max()


def test_prefill_kernel_declines_shapes_outside_its_vectors():
    """Protects the fallback: a head dim or block size that is not a multiple of 16 goes to SDPA, not the kernel."""
    q = torch.zeros(4, 4, 40)
    assert native.supports(q, torch.zeros(2, 3, 16, 2, 40)) and not native.supports_prefill(q, torch.zeros(2, 3, 16, 2, 40))
    q = torch.zeros(4, 4, 64)
    assert not native.supports_prefill(q, torch.zeros(2, 3, 8, 2, 64))
    assert native.supports_prefill(q, torch.zeros(2, 3, 16, 2, 64))


def test_engine_greedy_tokens_are_the_same_with_and_without_the_kernel(tmp_path, monkeypatch):
    """Protects end-to-end outputs: 4 requests of different lengths (partial and multi-block), 12 greedy tokens each,
    identical tokens."""
    from tandem import LLM, SamplingParams
    from tandem.engine.tiny_model import make_tiny_model

    path = make_tiny_model(tmp_path / "m", "qwen3", "1m", seed=3)
    prompts = [[(7 * i + j) % 200 + 3 for j in range(n)] for i, n in enumerate((5, 33, 90, 140))]
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm = LLM(path, max_num_batched_tokens=512)
    with_kernel = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    monkeypatch.setattr(native, "supports", lambda q, kv: False)
    without = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    assert with_kernel == without
    assert all(len(t) == 12 for t in with_kernel)


@pytest.fixture
def fresh_loader(monkeypatch, tmp_path):
    """native.load() as in a new process (nothing loaded or tried yet), with an empty kernel cache."""
    for name, value in (("_tried", False), ("_lib", None), ("_why", None), ("_limits", None),
                        ("_prefill_limits", None)):
        monkeypatch.setattr(native, name, value)
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TANDEM_CPU_ATTENTION", raising=False)
    monkeypatch.delenv("CC", raising=False)
    return monkeypatch


@pytest.mark.parametrize("env,why", [({"TANDEM_CPU_ATTENTION": "sdpa"}, "turned off by TANDEM_CPU_ATTENTION"),
                                     ({"CC": "false"}, "RuntimeError: false failed")])
def test_without_the_kernel_the_sdpa_path_runs_and_says_why(env, why, fresh_loader, sdpa_only):
    """Protects the fallback: turned off, or no working compiler (an empty cache), the kernel is not used, the
    reason is kept, and attention still runs (through the SDPA path, same outputs)."""
    for k, v in env.items():
        fresh_loader.setenv(k, v)
    q, k, v, kv, meta = _attend([1, 1, 5], [3, 40, 5], 4, 2, 16, 16, seed=7)
    assert native.load() is None and native.supports(q, kv) is False
    assert native.unavailable_reason().startswith(why)
    got = SdpaBackend().forward(q, k, v, kv.clone(), meta(), 0.25)
    sdpa_only()
    assert torch.equal(got, SdpaBackend().forward(q, k, v, kv.clone(), meta(), 0.25))


def test_a_prefill_kernel_that_does_not_compile_leaves_the_decode_kernel(fresh_loader, tmp_path, sdpa_only):
    """Protects the partial fallback: a compiler that rejects the prefill source still gets the decode kernel; prefill
    chunks then run on SDPA, with the same outputs."""
    broken = tmp_path / "paged_prefill.c"
    broken.write_text("this is not C\n")
    fresh_loader.setattr(native, "SOURCES", (native.SOURCE, broken))
    q, k, v, kv, meta = _attend([1, 9, 1], [30, 9, 17], 8, 4, 64, 16, seed=11)
    assert native.load() is not None and native.supports(q, kv)
    assert not native.supports_prefill(q, kv)
    got = SdpaBackend().forward(q, k, v, kv.clone(), meta(), 0.125)
    sdpa_only()
    want = SdpaBackend().forward(q, k, v, kv.clone(), meta(), 0.125)
    assert torch.allclose(got, want, atol=2e-6, rtol=1e-5)



def _vector_flags() -> tuple[str, ...]:
    from tandem.bench.host import describe_host
    return describe_host().vector_extensions


@pytest.mark.skipif(__import__("platform").machine() != "x86_64" or "avx2" not in _vector_flags(),
                    reason="needs an x86-64 CPU with AVX2")
def test_the_avx2_build_takes_8_float_vectors_and_gives_the_same_bits():
    """Protects the AVX2 variant (TANDEM_CPU_ISA=avx2, what an AVX2-only host compiles): it runs 8-float vectors and
    its decode and prefill outputs equal the loaded build's bit for bit (each lane's arithmetic is the same at either
    width). Compiled once into the kernel cache, as the loaded build is."""
    from tandem.engine.attention.isa import IsaCap, isa_cap
    avx2 = native.build(IsaCap.AVX2)
    assert avx2.tandem_simd_width() == 8
    assert native.vector_width() == (16 if "avx512f" in _vector_flags() and isa_cap() is None else 8)
    # rows: 0 decodes seq 0 (300 tokens), 1-70 a fresh 70-token prompt, 71 decodes seq 2 (17), 72-104 a 33-token
    # chunk after a 67-token prefix
    q, k, v, kv, meta = _attend([1, 70, 1, 33], [300, 70, 17, 100], 8, 4, 64, 32, seed=5, reverse_tables=True)
    m = meta()
    SdpaBackend().forward(q, k, v, kv, m, 0.125)             # writes the step's K/V into the cache
    outs = []
    for lib in (None, avx2):
        out = torch.zeros_like(q)
        native.paged_decode(q, kv, m.block_tables, torch.tensor([0, 71]), torch.tensor([0, 2]),
                            torch.tensor([300, 17]), 0.125, out, lib=lib)
        native.paged_prefill(q, kv, m.block_tables, torch.tensor([1, 72]), torch.tensor([70, 33]),
                             torch.tensor([1, 3]), torch.tensor([70, 100]), 0.125, out, lib=lib)
        outs.append(out)
    assert outs[0].abs().min() > 0 and torch.equal(outs[0], outs[1])
