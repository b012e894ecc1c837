"""A step-time model fitted to measurements of the real engine, and the profile file that carries it.

`StepTimeModel.step_time(BatchShape)` replaces the roofline as a worker's step timer when the
simulator is given a profile (`tandem simulate --perf profile.json`). It is one
`tandem.perf.fit.PiecewiseLinear` over the features of a batch:

    [1, tokens, prefill_chunks, decode_seqs, prefill_attn_pairs, prefill_kv_read_tokens, decode_ctx_tokens]
    tokens = prefill_tokens + num_decode (every query token goes through the linear layers)

- 1: per-step fixed cost (weights streamed once, kernel launches, per-layer Python overhead);
- tokens: the linear layers (QKV/O projections, MLP) and the KV write, per query token;
- prefill_chunks and decode_seqs: per-sequence costs (a sampled row through the LM head and the
  sampler, the attention call of a prefill chunk, building its part of the batch); kept separate
  because an engine pays a prefill chunk's attention call per chunk but batches all decodes in one;
- prefill_attn_pairs: causal (query, key) pairs of the prefill chunks (attention FLOPs, the mask);
- prefill_kv_read_tokens: history KV gathered by the chunks;
- decode_ctx_tokens: KV read by the decode sequences.

The segment is chosen on `tokens`: small batches run matrix-vector kernels, large ones
matrix-matrix kernels with a different per-token cost. Coefficients are non-negative (a decode
therefore costs at least as much as a prefill token) and fitted on relative error, as every fit in
tandem (docs/cost-models.md). AMPD's T_pre and T_dec are derived from the same model (prefills
chunked by the engine's max_num_batched_tokens) so routing and the executor timer agree.

`Profile` is the JSON document `tandem profile` writes (docs/profiler.md); it lives here, free of
torch, so the simulator can read it.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from tandem.perf.ampd_cost import TYPICAL_CTX, AMPDCostModel, dec_features, kv_features, pre_features
from tandem.perf.fit import PiecewiseLinear, fit
from tandem.perf.batch_shape import BatchShape
from tandem.perf.collective import CollectiveCost, ShardedStepTimer
from tandem.perf.step_timer import StepTimer
from tandem.perf.window_profile import SECTION as DLLM_SECTION, WindowLatencyProfile

FEATURES = ("const", "tokens", "prefill_chunks", "decode_seqs", "prefill_attn_pairs", "prefill_kv_read_tokens",
            "decode_ctx_tokens")
KEY = 1                      # segments are chosen on the step's query tokens
SEGMENTS = 3
STEP_MODEL_VERSION = 1
PROFILE_FORMAT = "tandem-profile"
PROFILE_VERSION = 1
# KV transfer between two engine processes on one host when the profile measured none:
# a Unix-socket / loopback copy of a few GB/s and tens of microseconds per message.
DEFAULT_KV_LINK = {"bandwidth_bytes_per_s": 2e9, "latency_s": 50e-6, "source": "default"}
RUNTIME_FIELDS = ("request_s", "output_s", "hop_s", "step_gap_s", "msg_s", "host_token_s", "host_round_s")


def kv_link_seconds(link: Mapping[str, Any], nbytes: float) -> float:
    """One KV transfer of `nbytes` over a profile's kv_link: gather out of the source's paged cache (export),
    the wire (latency + bytes / bandwidth) and scatter into the destination's cache (import). Links measured
    before export/import were part of the profile have only the wire terms."""
    t = float(link["latency_s"]) + nbytes / float(link["bandwidth_bytes_per_s"])
    for side in ("export", "import"):
        t += _side_seconds(link, side, nbytes)
    return t


def _side_seconds(link: Mapping[str, Any], side: str, nbytes: float) -> float:
    bps = link.get(f"{side}_bytes_per_s")
    return float(link.get(f"{side}_s", 0.0)) + (nbytes / float(bps) if bps else 0.0)


@dataclass
class RuntimeCosts:
    """What tandem's live runtime adds around each engine step, for the simulator's host loop
    (`tandem.sim.loop.HostLoop`, docs/simulator.md "Runtime model"). Zero everywhere is an ideal runtime.

    From the profile's `runtime` block (measured on the live server by benchmarks/sim_to_real.py):
    request_s (client sends a round -> the coordinator routes it: HTTP, parsing), output_s (a token leaves
    its worker -> the client reads it), hop_s (one control message between the coordinator and a worker, each
    way), step_gap_s (a worker's loop between two engine steps: thread hand-off, sends, stats; added to every
    step), msg_s (a worker handling one control message between steps), step_factor (a prefill / decode step
    in a live worker process against the same step in the profiler, on an otherwise idle server),
    host_token_s / host_round_s (CPU seconds the serving processes besides the engines spend per token
    streamed and per round: coordinator, HTTP server, client) and cores (the host's cores they and the
    engines' steps share; 0: no CPU model).
    From the profile's `kv_link` (`tandem profile`): the wire (latency_s, bandwidth_bytes_per_s), the
    export/import work on the source/destination worker, which holds that worker between two steps, and the
    wire's encryption (crypto_s_per_byte: CPU on the two ends' I/O threads, shared with the steps).
    From the profile's `interference` (`tandem profile`: two engine processes side by side), or the runtime
    block's `interference` when it has one (the live server, whose coordinator, HTTP server and client share
    the host's cores too): how much slower a prefill / decode step runs while another worker is in a step.
    """

    request_s: float = 0.0
    output_s: float = 0.0
    hop_s: float = 0.0
    step_gap_s: float = 0.0
    msg_s: float = 0.0
    host_token_s: float = 0.0
    host_round_s: float = 0.0
    cores: int = 0
    kv_link: dict = field(default_factory=lambda: dict(DEFAULT_KV_LINK))
    interference: dict = field(default_factory=lambda: {"prefill": 1.0, "decode": 1.0})
    step_factor: dict = field(default_factory=lambda: {"prefill": 1.0, "decode": 1.0})

    def export_s(self, nbytes: float) -> float:
        """Seconds the source worker spends gathering and sending `nbytes` of KV."""
        return _side_seconds(self.kv_link, "export", nbytes)

    def import_s(self, nbytes: float) -> float:
        """Seconds the destination worker spends receiving and placing `nbytes` of KV."""
        return _side_seconds(self.kv_link, "import", nbytes)

    def crypto_s(self, nbytes: float) -> float:
        """CPU seconds the wire's encryption (CURVE, both ends) takes for `nbytes` of KV, beside the workers' steps."""
        return float(self.kv_link.get("crypto_s_per_byte", 0.0) or 0.0) * nbytes

    @classmethod
    def from_profile_fields(cls, runtime: Mapping | None, kv_link: Mapping, interference: Mapping | None) -> "RuntimeCosts":
        rt = dict(runtime or {})
        bad = {k: rt.get(k) for k in RUNTIME_FIELDS if k in rt and not (isinstance(rt[k], (int, float)) and rt[k] >= 0)}
        if bad:
            raise ValueError(f"profile runtime needs non-negative seconds, got {bad}")
        inter = {"prefill": 1.0, "decode": 1.0}
        # the runtime block's factors (measured on the live server) win over the engine-only measurement
        for k, v in {**dict(interference or {}), **dict(rt.get("interference") or {})}.items():
            if k in inter:
                if not (isinstance(v, (int, float)) and v >= 1.0):
                    raise ValueError(f"profile interference.{k} must be a factor >= 1, got {v!r}")
                inter[k] = float(v)
        factor = {"prefill": 1.0, "decode": 1.0}
        for k, v in dict(rt.get("step_factor") or {}).items():
            if k in factor:
                if not (isinstance(v, (int, float)) and v > 0):
                    raise ValueError(f"profile runtime.step_factor.{k} must be a factor > 0, got {v!r}")
                factor[k] = float(v)
        cores = rt.get("cores", 0)
        if not (isinstance(cores, int) and cores >= 0):
            raise ValueError(f"profile runtime.cores must be a non-negative integer, got {cores!r}")
        return cls(**{k: float(rt.get(k, 0.0)) for k in RUNTIME_FIELDS}, cores=cores, kv_link=dict(kv_link),
                   interference=inter, step_factor=factor)


def step_features(prefill_tokens: float, prefill_attn_pairs: float, prefill_kv_read_tokens: float,
                  num_prefill: float, num_decode: float, decode_ctx_tokens: float) -> tuple[float, ...]:
    """Feature vector of one step (BatchShape field order in, FEATURES order out)."""
    return (1.0, float(prefill_tokens + num_decode), float(num_prefill), float(num_decode),
            float(prefill_attn_pairs), float(prefill_kv_read_tokens), float(decode_ctx_tokens))


def shape_features(shape: BatchShape) -> tuple[float, ...]:
    """Feature vector of a BatchShape."""
    return step_features(shape.prefill_tokens, shape.prefill_attn_pairs, shape.prefill_kv_read_tokens,
                         shape.num_prefill, shape.num_decode, shape.decode_ctx_tokens)


def rel_errors(pred: Sequence[float], y: Sequence[float]) -> dict[str, float | None]:
    """Median, p90, mean and max of |pred - y| / y, plus the sample count (None without samples)."""
    p, t = np.asarray(pred, dtype=float), np.asarray(y, dtype=float)
    if len(t) == 0:
        return {"n": 0, "median": None, "p90": None, "mean": None, "max": None}
    e = np.abs(p - t) / np.maximum(np.abs(t), 1e-12)
    return {"n": int(len(t)), "median": float(np.median(e)), "p90": float(np.quantile(e, 0.9)),
            "mean": float(e.mean()), "max": float(e.max())}


def cross_validate_segments(X: np.ndarray, y: np.ndarray, max_segments: int, folds: int = 5,
                            seed: int = 0) -> dict[int, float]:
    """Mean relative error on held-out folds of a piecewise fit with 1..max_segments segments."""
    n = len(y)
    folds = min(folds, n)
    if folds < 2:
        return {1: 0.0}
    idx = np.random.default_rng(seed).permutation(n)
    out: dict[int, float] = {}
    for s in range(1, max(1, max_segments) + 1):
        errs = []
        for k in range(folds):
            test = idx[k::folds]
            train = np.setdiff1d(idx, test)
            f = fit(X[train], y[train], key=KEY, breakpoints=s)
            errs.extend(np.abs(f.predict_many(X[test]) - y[test]) / np.maximum(np.abs(y[test]), 1e-12))
        out[s] = float(np.mean(errs))
    return out


class StepTimeModel(StepTimer):
    """Seconds of one engine step as a piecewise-linear function of its BatchShape (see module doc)."""

    __slots__ = ("fit", "max_num_batched_tokens", "meta")

    def __init__(self, fit: PiecewiseLinear, max_num_batched_tokens: int, meta: dict | None = None) -> None:
        if len(fit.coefs[0]) != len(FEATURES) or fit.key != KEY:
            raise ValueError(f"step model needs {len(FEATURES)} coefficients per segment keyed on feature {KEY}, "
                             f"got {len(fit.coefs[0])} keyed on {fit.key}")
        self.fit = fit
        self.max_num_batched_tokens = int(max_num_batched_tokens)
        self.meta = dict(meta or {})

    # --- timer (hot path of the simulator) -------------------------------------------------
    def step_time_args(self, prefill_tokens: float, prefill_attn_pairs: float, prefill_kv_read_tokens: float,
                       num_prefill: float, num_decode: float, decode_ctx_tokens: float, graph: bool = False,
                       decode_kv_shared: float = 0) -> float:
        """`step_time` without building a BatchShape (same fields, same order; the fit has no graph or shared-KV
        feature, so those two are not used)."""
        tokens = prefill_tokens + num_decode
        if tokens <= 0:
            return 0.0
        return self.fit.predict((1.0, tokens, num_prefill, num_decode, prefill_attn_pairs, prefill_kv_read_tokens,
                                 decode_ctx_tokens))

    def prefill_time(self, l_hist: int, l_incr: int, chunk_tokens: int | None = None) -> float:
        """A prefill of l_incr tokens after l_hist resident ones, alone, in chunks of max_num_batched_tokens."""
        return super().prefill_time(l_hist, l_incr, chunk_tokens or self.max_num_batched_tokens)

    # --- fitting ---------------------------------------------------------------------------
    @classmethod
    def from_samples(cls, shapes: Sequence[BatchShape], seconds: Sequence[float], max_num_batched_tokens: int,
                     segments: int | Sequence[float] = SEGMENTS, meta: dict | None = None) -> "StepTimeModel":
        """Fit to measured steps (non-negative least squares on relative error, segments on tokens).

        segments: explicit breakpoints, or the most segments allowed; then the count (1..segments) is
        chosen by 5-fold cross-validation on the samples, so a sparse grid is not split into segments
        too small to pin down seven coefficients."""
        if len(shapes) != len(seconds) or not shapes:
            raise ValueError(f"need as many step times as shapes (and at least one), got {len(seconds)} for {len(shapes)}")
        X = np.array([shape_features(s) for s in shapes], dtype=float)
        y = np.asarray(seconds, dtype=float)
        cv: dict[int, float] = {}
        if isinstance(segments, (int, np.integer)):
            cv = cross_validate_segments(X, y, int(segments))
            segments = min(cv, key=lambda k: (cv[k], k))
        f = fit(X, y, key=KEY, breakpoints=segments)
        model = cls(f, max_num_batched_tokens, meta)
        model.meta["train_error"] = model.errors(shapes, seconds)
        if cv:
            model.meta["cv_mean_rel_error_by_segments"] = {str(k): v for k, v in cv.items()}
        return model

    def errors(self, shapes: Sequence[BatchShape], seconds: Sequence[float]) -> dict[str, float]:
        """Relative prediction errors on measured steps (median, p90, mean, max, n)."""
        return rel_errors([self.step_time(s) for s in shapes], seconds)

    def coefficients(self) -> list[dict[str, float | None]]:
        """Per segment: its token range and each feature's coefficient, for people to read."""
        bps = [0.0, *self.fit.breakpoints, None]          # None: no upper bound
        return [{"tokens_from": bps[i], "tokens_below": bps[i + 1], **dict(zip(FEATURES, c))}
                for i, c in enumerate(self.fit.coefs)]

    # --- AMPD's cost functions from the same model -----------------------------------------
    def ampd_cost_model(self, max_len: int, kv_capacity_tokens: int, kv_bytes_per_token: int,
                        max_num_seqs: int = 256, kv_link: Mapping[str, Any] | None = None,
                        meta: dict | None = None, tp: int = 1) -> AMPDCostModel:
        """AMPD's T_pre/T_dec at `tp` (the degree the steps were measured at) fitted to this model's chunked
        prefills and decode steps, and T_kv for one host (same values on the 'node' and 'net' paths)."""
        return ampd_from_timers({tp: self}, self.max_num_batched_tokens, max_len, kv_capacity_tokens,
                                kv_bytes_per_token, max_num_seqs, kv_link, meta)

    # --- persistence -----------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"version": STEP_MODEL_VERSION, "features": list(FEATURES), "fit": self.fit.to_dict(),
                "max_num_batched_tokens": self.max_num_batched_tokens, "coefficients": self.coefficients(),
                "meta": self.meta}

    @classmethod
    def from_dict(cls, d: Mapping) -> "StepTimeModel":
        if not isinstance(d, Mapping) or d.get("version") != STEP_MODEL_VERSION:
            v = d.get("version") if isinstance(d, Mapping) else None
            raise ValueError(f"step model format version {v!r} is not supported; expected {STEP_MODEL_VERSION}")
        if list(d.get("features", [])) != list(FEATURES):
            raise ValueError(f"step model features {d.get('features')!r} differ from {list(FEATURES)}")
        return cls(PiecewiseLinear.from_dict(d["fit"]), int(d["max_num_batched_tokens"]), dict(d.get("meta", {})))

    def __repr__(self) -> str:
        return f"StepTimeModel({self.fit.segments} segments, chunk {self.max_num_batched_tokens})"


def ampd_from_timers(timers: Mapping[int, StepTimer], chunk_tokens: int, max_len: int, kv_capacity_tokens: int,
                     kv_bytes_per_token: int, max_num_seqs: int = 256, kv_link: Mapping[str, Any] | None = None,
                     meta: dict | None = None) -> AMPDCostModel:
    """AMPD's T_pre/T_dec per tensor-parallel degree, each fitted to its step timer's chunked prefills and decode
    steps, and T_kv between every two of the degrees on one host (the same link values on 'node' and 'net')."""
    link = dict(DEFAULT_KV_LINK if kv_link is None else kv_link)
    max_len = max(int(max_len), 2)
    incr = sorted({int(round(v)) for v in np.geomspace(1, max_len, 4 * max(1, int(math.log2(max_len))) + 1)})
    hist = [0] + [h for h in (16 << i for i in range(40)) if h < max_len]
    batches = sorted({int(round(v)) for v in np.geomspace(1, max(1, max_num_seqs), 24)})
    ctxs = [c for c in (16 << i for i in range(40)) if c <= max_len] or [max_len]
    pre, dec = {}, {}
    for tp, timer in timers.items():
        pre_X, pre_y = [], []
        for h in hist:
            for n in incr:
                if h + n <= max_len:
                    pre_X.append(pre_features(h, n))
                    pre_y.append(timer.prefill_time(h, n))
        dec_X, dec_y = [], []
        for c in ctxs:
            for b in batches:
                if b * c <= kv_capacity_tokens or b == 1:
                    dec_X.append(dec_features(b, b * c))
                    dec_y.append(timer.decode_time(b, b * c))
        pre[tp], dec[tp] = (pre_X, pre_y), (dec_X, dec_y)
    toks = [1, 16, 256, 4096, 65536]
    kv_y = [kv_link_seconds(link, t * kv_bytes_per_token) for t in toks]
    kv_X = [kv_features(t) for t in toks]
    kv = {(a, b, same): (kv_X, kv_y) for a in timers for b in timers for same in (True, False)}
    m = {"source": "profile", "chunk_tokens": chunk_tokens, "kv_link": link, **(meta or {})}
    return AMPDCostModel.from_samples(pre, dec, kv, typical_ctx=min(TYPICAL_CTX, max(1, max_len // 2)), meta=m)


@dataclass
class Profile:
    """What `tandem profile` measured and fitted for one engine on one device (docs/profiler.md)."""

    model: str                                  # checkpoint path as given
    device: dict                                # type, name, cores/threads (CPU) or CUDA name and memory
    torch_version: str
    engine: dict                                # EngineConfig fields the engine was built with
    model_config: dict                          # layers, hidden, heads, kv_heads, head_dim, vocab, params, ...
    step_model: StepTimeModel
    ampd: AMPDCostModel                         # T_pre/T_dec/T_kv at the profiled tp, derived from step_model
    num_blocks: int
    block_size: int
    kv_bytes_per_token: int
    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int
    heldout_error: dict                         # median, p90, mean, max, n of |pred - measured| / measured
    train_error: dict
    kv_link: dict = field(default_factory=lambda: dict(DEFAULT_KV_LINK))
    interference: dict | None = None            # step slow-down while another engine process steps (measured)
    runtime: dict | None = None                 # the live runtime's latencies (RuntimeCosts fields + source)
    dllm_latency: WindowLatencyProfile | None = None   # block-diffusion models: T(c, b) over window steps
    measurements: list[dict] = field(default_factory=list)
    options: dict = field(default_factory=dict)
    wall_s: float = 0.0
    created: str = ""
    tensor_parallel_size: int = 1               # the ranks the profiled engine ran (its steps' and fits' degree)
    collective: CollectiveCost | None = None    # all-reduces measured on this host (tandem.perf.collective)

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the engine's KV pool holds (num_blocks x block_size)."""
        return self.num_blocks * self.block_size

    @property
    def name(self) -> str:
        """A short label for the profiled model: the checkpoint directory's name."""
        return Path(self.model.rstrip("/")).name or self.model

    @property
    def device_name(self) -> str:
        return str(self.device.get("name") or self.device.get("type") or "device")

    def to_dict(self) -> dict:
        return {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, "created": self.created, "model": self.model,
                "device": self.device, "torch_version": self.torch_version, "engine": self.engine,
                "model_config": self.model_config, "num_blocks": self.num_blocks, "block_size": self.block_size,
                "kv_capacity_tokens": self.kv_capacity_tokens, "kv_bytes_per_token": self.kv_bytes_per_token,
                "max_model_len": self.max_model_len, "max_num_batched_tokens": self.max_num_batched_tokens,
                "max_num_seqs": self.max_num_seqs, "heldout_error": self.heldout_error,
                "train_error": self.train_error, "kv_link": self.kv_link, "interference": self.interference,
                "runtime": self.runtime, "options": self.options,
                "wall_s": self.wall_s, "step_model": self.step_model.to_dict(), "ampd": self.ampd.to_dict(),
                "measurements": self.measurements, "tensor_parallel_size": self.tensor_parallel_size,
                "collective": None if self.collective is None else self.collective.to_dict(),
                **({DLLM_SECTION: self.dllm_latency.to_dict()} if self.dllm_latency is not None else {})}

    @classmethod
    def from_dict(cls, d: Mapping) -> "Profile":
        """Parse and validate; ValueError with one readable line when something is missing or wrong."""
        if not isinstance(d, Mapping) or d.get("format") != PROFILE_FORMAT:
            raise ValueError(f"not a tandem profile (no \"format\": \"{PROFILE_FORMAT}\")")
        if d.get("version") != PROFILE_VERSION:
            raise ValueError(f"profile version {d.get('version')!r} is not supported; expected {PROFILE_VERSION}")
        try:
            p = cls(model=str(d["model"]), device=dict(d["device"]), torch_version=str(d["torch_version"]),
                    engine=dict(d["engine"]), model_config=dict(d["model_config"]),
                    step_model=StepTimeModel.from_dict(d["step_model"]), ampd=AMPDCostModel.from_dict(d["ampd"]),
                    num_blocks=int(d["num_blocks"]), block_size=int(d["block_size"]),
                    kv_bytes_per_token=int(d["kv_bytes_per_token"]), max_model_len=int(d["max_model_len"]),
                    max_num_batched_tokens=int(d["max_num_batched_tokens"]), max_num_seqs=int(d["max_num_seqs"]),
                    heldout_error=dict(d["heldout_error"]), train_error=dict(d.get("train_error", {})),
                    kv_link=dict(d.get("kv_link") or DEFAULT_KV_LINK),
                    interference=dict(d["interference"]) if d.get("interference") is not None else None,
                    runtime=dict(d["runtime"]) if d.get("runtime") is not None else None,
                    measurements=list(d.get("measurements", [])),
                    options=dict(d.get("options", {})), wall_s=float(d.get("wall_s", 0.0)),
                    created=str(d.get("created", "")),
                    tensor_parallel_size=int(d.get("tensor_parallel_size", 1)),
                    collective=CollectiveCost.from_dict(d["collective"]) if d.get("collective") is not None else None,
                    dllm_latency=WindowLatencyProfile.from_dict(d[DLLM_SECTION])
                    if d.get(DLLM_SECTION) is not None else None)
        except KeyError as e:
            raise ValueError(f"profile is missing the field {e.args[0]!r}") from None
        except (TypeError, IndexError, AttributeError) as e:
            raise ValueError(f"profile has a malformed field ({e})") from None
        for name in ("num_blocks", "block_size", "kv_bytes_per_token", "max_model_len", "max_num_batched_tokens",
                     "max_num_seqs"):
            if getattr(p, name) < 1:
                raise ValueError(f"profile field {name} must be >= 1, got {getattr(p, name)}")
        tp = p.tensor_parallel_size
        if tp < 1:
            raise ValueError(f"profile field tensor_parallel_size must be >= 1, got {tp}")
        if tp not in p.ampd.pre or tp not in p.ampd.dec:
            raise ValueError(f"profile's AMPD cost model has no tp{tp} fit (the degree it was profiled at)")
        bw, lat = p.kv_link.get("bandwidth_bytes_per_s"), p.kv_link.get("latency_s")
        if not (isinstance(bw, (int, float)) and bw > 0 and isinstance(lat, (int, float)) and lat >= 0):
            raise ValueError(f"profile kv_link needs bandwidth_bytes_per_s > 0 and latency_s >= 0, got {p.kv_link}")
        for side in ("export", "import"):
            for key in (f"{side}_s", f"{side}_bytes_per_s"):
                v = p.kv_link.get(key)
                if v is not None and not (isinstance(v, (int, float)) and v >= 0):
                    raise ValueError(f"profile kv_link.{key} must be a non-negative number, got {v!r}")
        p.runtime_costs()                        # validates the runtime and interference blocks
        return p

    def priced_tps(self) -> tuple[int, ...]:
        """The degrees this profile prices a worker at: the one it was profiled at, and from a tp1 profile every
        rank count its collective fit measured (compute divided, all-reduces added: tandem.perf.collective)."""
        extra = sorted(self.collective.fits) if self.tensor_parallel_size == 1 and self.collective else []
        return tuple(sorted({self.tensor_parallel_size, *extra}))

    def refusal(self, tp: int) -> str | None:
        """Why this profile cannot price a tp worker (one line), None when it can."""
        if tp in self.priced_tps():
            return None
        how = "" if self.tensor_parallel_size > 1 else (f" and no all-reduce among {tp} ranks (profile with "
                                                       f"--tensor-parallel-size {tp} on a host with {tp} cores)")
        return (f"the profile measured one engine at tp{self.tensor_parallel_size}{how}; it prices tp"
                f"{'/tp'.join(map(str, self.priced_tps()))} workers, not tp{tp}")

    def step_timer(self, tp: int) -> StepTimer:
        """The step timer of a tp worker: the fitted model at the profiled degree, a ShardedStepTimer for another
        degree a tp1 profile's collective fit covers; ValueError (one line) otherwise."""
        why = self.refusal(tp)
        if why:
            raise ValueError(why)
        if tp == self.tensor_parallel_size:
            return self.step_model
        return ShardedStepTimer(self.step_model, tp, self.collective)

    def cost_model(self, tps: Sequence[int]) -> AMPDCostModel:
        """AMPD's costs for workers at the degrees `tps`: the profile's own fit when they are all the profiled
        degree, else fits of each degree's step timer; ValueError (one line) for a degree it cannot price."""
        tps = sorted(set(tps))
        for tp in tps:
            why = self.refusal(tp)
            if why:
                raise ValueError(why)
        if tps == [self.tensor_parallel_size]:
            return self.ampd
        max_len = int(self.options.get("profiled_max_len") or self.max_model_len)     # as the profile's own fit
        return ampd_from_timers({tp: self.step_timer(tp) for tp in tps}, self.max_num_batched_tokens,
                                max_len, self.kv_capacity_tokens, self.kv_bytes_per_token,
                                self.max_num_seqs, self.kv_link, {"model": self.model, "gpu": self.device_name})

    def runtime_costs(self) -> RuntimeCosts:
        """The host-loop costs of this profile (zeros for what it did not measure)."""
        return RuntimeCosts.from_profile_fields(self.runtime, self.kv_link, self.interference)

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1, allow_nan=False) + "\n")

    @classmethod
    def from_json(cls, path: str | Path) -> "Profile":
        try:
            d = json.loads(Path(path).read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON ({e.msg} at line {e.lineno})") from None
        return cls.from_dict(d)


def is_profile_dict(d: Any) -> bool:
    """Whether a parsed JSON document claims to be a `tandem profile` output."""
    return isinstance(d, Mapping) and d.get("format") == PROFILE_FORMAT
