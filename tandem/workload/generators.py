"""Synthetic multi-round workloads matching the AMPD paper's Table 1 (ToolBench, GAIA, HotpotQA, DuReader),
plus the `agentic-long` stress workload and LAPS's multi-turn chat mix (`chat-multiturn`).

The paper publishes only the means of each trace (rounds, per-round prefill and decode lengths),
so every distribution here is an explicit, documented choice (`WorkloadSpec`), calibrated
analytically so that its *population* means equal the table; see docs/session-format.md.
`chat-multiturn` (`ChatSpec`) is calibrated the same way to LAPS's fractions of short prompts.
"""
from __future__ import annotations

import dataclasses
import math
import zlib
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from tandem.workload.arrivals import check_rate, check_seed, poisson_arrivals
from tandem.workload.session import SLO, Round, Session, WorkloadError
from tandem.workload.traces import sharegpt_file, sharegpt_lengths
from tandem.workload.options import PREFILL_BASES


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """Every distribution of one synthetic multi-round workload (means are the Table 1 targets)."""

    name: str
    kind: str                   # "agentic" (tool-using agent) or "rag" (iterative retrieval-augmented generation)
    # rounds per session: "fixed" (= mean_rounds), or 1 + N capped at max_rounds with N ~ "poisson" or "negbin"
    rounds_dist: str
    mean_rounds: float          # E[rounds] (Table 1), after the cap
    rounds_shape: float | None  # negative-binomial shape r (smaller = heavier tail); None unless rounds_dist == "negbin"
    max_rounds: int
    # input_tokens of a round (initial prompt, then new tokens appended): rint(lognormal) clipped to [1, input_max]
    mean_prefill_tokens: float  # Table 1 "prefill length": mean over all rounds of what prefill_basis names
    input_sigma: float          # sigma of log(length)
    input_first_factor: float   # E[round-0 input] / E[later-round input]
    input_max: int
    # output_tokens of a round: rint(lognormal) clipped to [1, output_max]
    mean_output_tokens: float   # mean over all rounds (Table 1 "decode length")
    output_sigma: float
    output_max: int
    # tool_s after every round but the last: lognormal with this median, clipped to [tool_min_s, tool_max_s]
    tool_median_s: float
    tool_sigma: float
    tool_min_s: float
    tool_max_s: float
    why: str = ""               # one-paragraph rationale, quoted by the docs
    # what Table 1's prefill length measures: "input" = the new tokens each round prefills (input_tokens);
    # "prompt" = each round's whole prompt (history + new tokens), as a log of per-round requests records it
    prefill_basis: str = "input"

    def __post_init__(self) -> None:
        bad = _spec_problem(self)
        if bad:
            raise WorkloadError(f"workload spec {self.name!r}: {bad}")




def _spec_problem(s: WorkloadSpec) -> str:
    if s.kind not in ("agentic", "rag"):
        return f"kind must be 'agentic' or 'rag', got {s.kind!r}"
    if s.rounds_dist not in ("fixed", "poisson", "negbin"):
        return f"rounds_dist must be 'fixed', 'poisson' or 'negbin', got {s.rounds_dist!r}"
    if s.rounds_dist == "fixed" and (s.mean_rounds != int(s.mean_rounds) or s.mean_rounds < 1):
        return f"fixed rounds need an integer mean_rounds >= 1, got {s.mean_rounds}"
    if s.rounds_dist != "fixed" and not (1 < s.mean_rounds < s.max_rounds):
        return f"mean_rounds must lie in (1, max_rounds={s.max_rounds}), got {s.mean_rounds}"
    if (s.rounds_dist == "negbin") != (s.rounds_shape is not None and s.rounds_shape > 0):
        return "rounds_shape must be > 0 exactly when rounds_dist is 'negbin'"
    if s.prefill_basis not in PREFILL_BASES:
        return f"prefill_basis must be one of {', '.join(PREFILL_BASES)}, got {s.prefill_basis!r}"
    if not (1 <= s.mean_prefill_tokens < s.input_max and 1 <= s.mean_output_tokens < s.output_max):
        return "mean token lengths must lie in [1, max)"
    if min(s.input_sigma, s.output_sigma, s.tool_sigma, s.input_first_factor) <= 0:
        return "sigmas and input_first_factor must be > 0"
    if not (0 <= s.tool_min_s <= s.tool_median_s <= s.tool_max_s):
        return "need 0 <= tool_min_s <= tool_median_s <= tool_max_s"
    return ""


WORKLOADS: dict[str, WorkloadSpec] = {
    "toolbench": WorkloadSpec(
        name="toolbench", kind="agentic",
        rounds_dist="poisson", mean_rounds=3.96, rounds_shape=None, max_rounds=16,
        mean_prefill_tokens=703.79, input_sigma=0.6, input_first_factor=3.0, input_max=16_384,
        mean_output_tokens=50.39, output_sigma=0.5, output_max=1_024,
        tool_median_s=1.0, tool_sigma=0.8, tool_min_s=0.05, tool_max_s=30.0,
        why=("ReAct chains over RapidAPI tools: a long first prompt (system prompt, tool schemas, query) "
             "then short API observations; a few calls per task with little spread (1 + Poisson); "
             "short thought+action JSON outputs; REST calls take about a second."),
    ),
    "gaia": WorkloadSpec(
        name="gaia", kind="agentic",
        rounds_dist="negbin", mean_rounds=11.32, rounds_shape=1.5, max_rounds=100,
        mean_prefill_tokens=6161.02, input_sigma=1.1, input_first_factor=1.0, input_max=65_536,
        mean_output_tokens=528.76, output_sigma=0.9, output_max=8_192,
        tool_median_s=4.0, tool_sigma=1.2, tool_min_s=0.1, tool_max_s=600.0,
        why=("General assistants that browse, read files and run code: most tasks end in a handful of "
             "steps, some run to the step limit (1 + negative binomial, shape 1.5, capped at 100); "
             "tool results are whole web pages or files (wide lognormal); search/browse/code tools take "
             "seconds with a heavy tail to minutes."),
    ),
    "hotpotqa": WorkloadSpec(
        name="hotpotqa", kind="rag",
        rounds_dist="fixed", mean_rounds=3, rounds_shape=None, max_rounds=3,
        mean_prefill_tokens=1569.8, input_sigma=0.35, input_first_factor=1.0, input_max=8_192,
        mean_output_tokens=80.03, output_sigma=0.5, output_max=1_024,
        tool_median_s=0.4, tool_sigma=0.5, tool_min_s=0.05, tool_max_s=5.0,
        why=("Iterative RAG with exactly three retrieval calls (AMPD App. B): each round appends a fixed "
             "top-k of Wikipedia passages, so lengths vary little; short multi-hop answers/queries; "
             "a retrieval (embedding + vector search) takes a few hundred milliseconds."),
    ),
    "dureader": WorkloadSpec(
        name="dureader", kind="rag",
        rounds_dist="fixed", mean_rounds=3, rounds_shape=None, max_rounds=3,
        mean_prefill_tokens=3081.23, input_sigma=0.4, input_first_factor=1.0, input_max=16_384,
        mean_output_tokens=150.10, output_sigma=0.5, output_max=2_048,
        tool_median_s=0.6, tool_sigma=0.5, tool_min_s=0.05, tool_max_s=8.0,
        why=("Iterative RAG over Baidu web documents, three retrieval calls: longer retrieved documents "
             "than HotpotQA with a little more spread, longer answers, somewhat slower retrieval."),
    ),
}


@dataclass(frozen=True, slots=True)
class AgenticLongSpec:
    """Distributions of the `agentic-long` stress workload: hundreds of rounds, ~200K-token contexts, long tool gaps."""

    min_rounds: int = 100            # rounds ~ uniform integer in [min_rounds, max_rounds]
    max_rounds: int = 400
    first_input_median: float = 4_000.0   # system prompt + tool schemas + task, lognormal
    first_input_sigma: float = 0.5
    input_median: float = 400.0      # later rounds: tool results, lognormal
    input_sigma: float = 1.0
    output_median: float = 150.0     # every round's output, lognormal
    output_sigma: float = 0.8
    output_max: int = 4_096
    context_min_tokens: int = 64_000  # per-session context budget ~ uniform in [min, max]; a session whose
    context_max_tokens: int = 200_000  # raw lengths exceed it has all rounds after the first scaled down to fit
    tool_min_s: float = 1.0          # tool gaps ~ log-uniform in [tool_min_s, tool_max_s]: seconds to hours
    tool_max_s: float = 3 * 3600.0


AGENTIC_LONG = AgenticLongSpec()


@dataclass(frozen=True, slots=True)
class ChatSpec:
    """Distributions of the `chat-multiturn` workload: LAPS's multi-turn chat length mix (LAPS §1, §2.3, Fig. 2).

    Round 0 is the first user prompt (system prompt included), every later round the new user tokens
    of the next turn, prefilled on top of the history (a re-prefill). The fractions of short prompts
    (< `short_tokens`) are LAPS's LMSYS-Chat-1M figures and hold exactly in the population (see
    `chat_calibration`); the long first prompts and every output are ShareGPT lengths.
    """

    name: str = "chat-multiturn"
    short_tokens: int = 256               # "short" means fewer than this many tokens (LAPS Fig. 2)
    first_short_fraction: float = 0.63    # P(round-0 prompt < short_tokens): LAPS Fig. 2, left
    later_short_fraction: float = 0.81    # P(later round's new input < short_tokens): LAPS Fig. 2, right
    # round 0: with probability first_short_fraction a draw from ShareGPT's num_prefill_tokens < short_tokens,
    # else one from its num_prefill_tokens >= short_tokens (each uniform over the file's rows of that part)
    # later rounds: rint(lognormal(mu, later_input_sigma)) clipped to [1, later_input_max], mu solved
    later_input_sigma: float = 1.5
    later_input_max: int = 8_192
    # output_tokens of every round: uniform over the file's num_decode_tokens
    # rounds = min(1 + N, max_rounds), N negative binomial of shape rounds_shape (1: geometric), capped mean
    mean_rounds: float = 2.0
    rounds_shape: float = 1.0
    max_rounds: int = 16
    # the user's think time between turns (tool_s of every round but the last): lognormal, clipped
    think_median_s: float = 20.0
    think_sigma: float = 1.0
    think_min_s: float = 1.0
    think_max_s: float = 600.0
    lengths_file: str | None = None       # ShareGPT length statistics CSV; None: the shipped trace (traces_dir())
    why: str = (
        "Chat turns as LAPS measures them on LMSYS-Chat-1M: 63% of first prompts and 81% of later new "
        "inputs are under 256 tokens, the later ones shorter because a re-prefill carries only the user's "
        "new message. First prompts resample ShareGPT's real prompt lengths, reweighted to that 63%, so the "
        "long ones are ShareGPT's long tail (LAPS evaluates on both datasets); later inputs are a wide "
        "lognormal (median ~68: a few dozen tokens, a few pasted documents); outputs are ShareGPT's. "
        "Conversations average 2 turns (LMSYS) with a geometric tail (the user goes on with probability "
        "~1/2 after each turn), capped at 16; between turns the user reads and types for tens of seconds.")

    def __post_init__(self) -> None:
        bad = _chat_problem(self)
        if bad:
            raise WorkloadError(f"workload spec {self.name!r}: {bad}")


def _chat_problem(s: ChatSpec) -> str:
    if not (isinstance(s.short_tokens, int) and 2 <= s.short_tokens <= s.later_input_max):
        return f"short_tokens must be an integer in [2, later_input_max={s.later_input_max}], got {s.short_tokens!r}"
    for name in ("first_short_fraction", "later_short_fraction"):
        if not (0.0 < getattr(s, name) < 1.0):
            return f"{name} must lie in (0, 1), got {getattr(s, name)!r}"
    if not (1 < s.mean_rounds < s.max_rounds and s.rounds_shape > 0):
        return f"need 1 < mean_rounds < max_rounds={s.max_rounds} and rounds_shape > 0"
    if min(s.later_input_sigma, s.think_sigma) <= 0:
        return "sigmas must be > 0"
    if not (0 <= s.think_min_s <= s.think_median_s <= s.think_max_s):
        return "need 0 <= think_min_s <= think_median_s <= think_max_s"
    return ""


CHAT = ChatSpec()

CHAT_SLO = SLO(0.4, 0.1)
"""`chat-multiturn`'s SLO: LAPS Fig. 7's TTFT SLO (0.4 s); LAPS sets no ITL SLO (it measures prefill), so the
ITL objective is DistServe's chatbot TPOT (0.1 s), loose enough that attainment is decided by TTFT as in Fig. 7."""

WORKLOAD_SLOS: dict[str, SLO] = {"chat-multiturn": CHAT_SLO}
"""Default SLOs of workloads whose paper gives one SLO for every model (AMPD's are per model: PAPER_SLOS)."""

PAPER_SLOS: dict[tuple[str, str], SLO] = {
    ("qwen3-32b", "toolbench"): SLO(0.35, 0.040),
    ("qwen3-32b", "gaia"): SLO(1.0, 0.035),
    ("qwen3-32b", "hotpotqa"): SLO(0.45, 0.030),
    ("qwen3-32b", "dureader"): SLO(1.2, 0.040),
    ("llama-3.1-70b", "toolbench"): SLO(1.0, 0.050),
    ("llama-3.1-70b", "gaia"): SLO(1.5, 0.035),
    ("llama-3.1-70b", "hotpotqa"): SLO(2.5, 0.045),
    ("llama-3.1-70b", "dureader"): SLO(5.0, 0.050),
    ("mixtral-8x7b", "toolbench"): SLO(0.13, 0.030),
    ("mixtral-8x7b", "gaia"): SLO(0.35, 0.020),
    ("mixtral-8x7b", "hotpotqa"): SLO(0.15, 0.025),
    ("mixtral-8x7b", "dureader"): SLO(0.30, 0.050),
}
"""AMPD Fig. 4 SLOs (TTFT, ITL) per (model, workload)."""

PAPER_GPUS: dict[str, int] = {"toolbench": 8, "hotpotqa": 8, "dureader": 16, "gaia": 32}
"""GPUs AMPD gives each workload (§7: one server for HotpotQA/ToolBench, two for DuReader, four for GAIA)."""

GENERATOR_NAMES: tuple[str, ...] = (*WORKLOADS, "agentic-long", "chat-multiturn")


def default_slo(model: str, workload: str) -> SLO | None:
    """The SLO a generated `workload` gets by default: AMPD's for (model, workload), else the workload's own
    (WORKLOAD_SLOS, any model), else None."""
    slo = PAPER_SLOS.get((model, workload))
    return slo if slo is not None else WORKLOAD_SLOS.get(workload)


def paper_slo(model: str, workload: str) -> SLO:
    """The AMPD Fig. 4 SLO for `model` on `workload`, or WorkloadError naming the valid pairs."""
    slo = PAPER_SLOS.get((model, workload))
    if slo is None:
        models = sorted({m for m, _ in PAPER_SLOS})
        raise WorkloadError(f"no paper SLO for model {model!r} on workload {workload!r} "
                            f"(models: {', '.join(models)}; workloads: {', '.join(WORKLOADS)})")
    return slo


def workload_spec(name: str) -> WorkloadSpec:
    """The WorkloadSpec called `name`, or WorkloadError listing the valid names."""
    spec = WORKLOADS.get(name) if isinstance(name, str) else None
    if spec is None:
        raise WorkloadError(f"unknown workload {name!r} (valid: {', '.join(GENERATOR_NAMES)})")
    return spec


# --------------------------------------------------------------------------- calibration


def _clipped_lognormal_mean(mu: float, sigma: float, hi: int) -> float:
    """E[clip(rint(exp(mu + sigma Z)), 1, hi)] = 1 + sum_{k=2..hi} P(exp(mu + sigma Z) >= k - 0.5)."""
    from scipy import special

    k = np.arange(2, hi + 1, dtype=np.float64)
    return 1.0 + float(special.ndtr((mu - np.log(k - 0.5)) / sigma).sum())


@lru_cache(maxsize=256)
def lognormal_mu_for_mean(mean: float, sigma: float, hi: int) -> float:
    """The mu whose clipped, rounded lognormal (sigma, [1, hi]) has exactly `mean`: lengths hit Table 1."""
    from scipy import optimize

    guess = math.log(mean) - sigma * sigma / 2
    f = lambda mu: _clipped_lognormal_mean(mu, sigma, hi) - mean  # noqa: E731
    return float(optimize.brentq(f, guess - 10.0, guess + 10.0 + sigma * sigma, xtol=1e-10))


def _rounds_pmf(dist: str, param: float, shape: float | None, cap: int) -> np.ndarray:
    """P(R = r) for r = 0..cap, R = min(1 + N, cap), N Poisson(param) or NB(shape, mean param)."""
    from scipy import stats

    n = np.arange(0, cap - 1)
    law = stats.poisson(param) if dist == "poisson" else stats.nbinom(shape, shape / (shape + param))
    pmf = np.zeros(cap + 1)
    pmf[1:cap] = law.pmf(n)
    pmf[cap] = law.sf(cap - 2)
    return pmf


def rounds_mean(dist: str, param: float, shape: float | None, cap: int) -> float:
    """E[min(1 + N, cap)] = 1 + sum_{j=1..cap-1} P(N >= j), N Poisson(param) or NB(shape, mean param)."""
    from scipy import stats

    j = np.arange(0, cap - 1)
    sf = stats.poisson.sf(j, param) if dist == "poisson" else stats.nbinom.sf(j, shape, shape / (shape + param))
    return 1.0 + float(sf.sum())


@lru_cache(maxsize=64)
def rounds_param_for_mean(dist: str, mean_rounds: float, shape: float | None, cap: int) -> float:
    """Mean of N such that min(1 + N, cap) averages `mean_rounds` (the cap trims a little of the tail)."""
    from scipy import optimize

    f = lambda m: rounds_mean(dist, m, shape, cap) - mean_rounds  # noqa: E731
    return float(optimize.brentq(f, 1e-9, 50.0 * cap, xtol=1e-12))


@dataclass(frozen=True, slots=True)
class _Calibrated:
    rounds_param: float
    mu_input_first: float
    mu_input_later: float
    mu_output: float


def input_means(spec: WorkloadSpec) -> tuple[float, float]:
    """Mean input_tokens of round 0 and of a later round that make the Table 1 prefill length exact.

    Over all rounds of all sessions, with R the rounds, f = input_first_factor, m the later-round
    input mean and o the output mean: the summed new inputs are E[f m + (R - 1) m], and the summed
    prompts are E[f m R + (m + o) R (R - 1) / 2] (round k's prompt holds every earlier input and
    output), each divided by E[R] to give the per-round mean.
    """
    if spec.rounds_dist == "fixed":
        er = float(spec.mean_rounds)
        epairs = er * (er - 1.0) / 2.0
    else:
        param = rounds_param_for_mean(spec.rounds_dist, spec.mean_rounds, spec.rounds_shape, spec.max_rounds)
        pmf = _rounds_pmf(spec.rounds_dist, param, spec.rounds_shape, spec.max_rounds)
        r = np.arange(spec.max_rounds + 1, dtype=np.float64)
        er, epairs = float(pmf @ r), float(pmf @ (r * (r - 1.0) / 2.0))
    f, target, out = spec.input_first_factor, spec.mean_prefill_tokens, spec.mean_output_tokens
    if spec.prefill_basis == "input":
        later = target * er / (f + er - 1.0)
    else:
        later = (target * er - out * epairs) / (f * er + epairs)
        if later < 1.0:
            raise WorkloadError(f"workload spec {spec.name!r}: outputs alone make the mean prompt exceed "
                                f"{target}; no input length can match it")
    return f * later, later


def calibration_key(spec: WorkloadSpec) -> tuple:
    """What a spec's calibration depends on: every field but its name and rationale."""
    return tuple(getattr(spec, f.name) for f in dataclasses.fields(spec) if f.name not in ("name", "why"))


@lru_cache(maxsize=64)
def _calibrate(spec: WorkloadSpec) -> _Calibrated:
    """The spec's solved parameters: stored for the built-in specs (tandem.workload.calibrated), else solved."""
    from tandem.workload.calibrated import CALIBRATED

    stored = CALIBRATED.get(calibration_key(spec))
    if stored is not None:
        return _Calibrated(*stored)
    return solve_calibration(spec)


def solve_calibration(spec: WorkloadSpec) -> _Calibrated:
    """Solve the spec's rounds parameter and lognormal mus with scipy (root finding on exact means)."""
    rounds_param = 0.0
    if spec.rounds_dist != "fixed":
        rounds_param = rounds_param_for_mean(spec.rounds_dist, spec.mean_rounds, spec.rounds_shape, spec.max_rounds)
    first, later = input_means(spec)
    if first >= spec.input_max:
        raise WorkloadError(f"workload spec {spec.name!r}: first-round mean {first:.0f} exceeds input_max")
    return _Calibrated(
        rounds_param,
        lognormal_mu_for_mean(first, spec.input_sigma, spec.input_max),
        lognormal_mu_for_mean(later, spec.input_sigma, spec.input_max),
        lognormal_mu_for_mean(spec.mean_output_tokens, spec.output_sigma, spec.output_max),
    )


# --------------------------------------------------------------------------- generation


def _check_count(num_sessions: int) -> int:
    if isinstance(num_sessions, bool) or not isinstance(num_sessions, (int, np.integer)) or num_sessions < 1:
        raise WorkloadError(f"num_sessions must be an integer >= 1, got {num_sessions!r}")
    return int(num_sessions)


def _streams(name: str, seed: int, n: int) -> list[np.random.Generator]:
    """Independent streams per quantity, so session i is the same whatever num_sessions or rate is."""
    seq = np.random.SeedSequence([check_seed(seed), zlib.crc32(name.encode())])
    return [np.random.default_rng(s) for s in seq.spawn(n)]


def _lognormal_ints(rng: np.random.Generator, mu: np.ndarray | float, sigma: float, hi: int, n: int) -> np.ndarray:
    x = np.rint(np.exp(mu + sigma * rng.standard_normal(n)))
    return np.clip(x, 1, hi).astype(np.int64)


def generate(name: str | WorkloadSpec, num_sessions: int, rate: float, seed: int,
             slo: SLO | None = None, prefill_basis: str | None = None) -> list[Session]:
    """Synthetic sessions of workload `name` (Table 1 means), Poisson arrivals at `rate`/s; deterministic per seed.

    `prefill_basis` ("input" or "prompt") overrides what the spec reads Table 1's prefill length as.
    """
    if isinstance(name, str) and name == "agentic-long":
        return agentic_long(num_sessions, seed, rate=rate, slo=slo)
    if isinstance(name, str) and name == "chat-multiturn":
        return chat_multiturn(num_sessions, seed, rate=rate, slo=slo)
    spec = name if isinstance(name, WorkloadSpec) else workload_spec(name)
    if prefill_basis is not None and prefill_basis != spec.prefill_basis:
        spec = dataclasses.replace(spec, prefill_basis=prefill_basis)
    n = _check_count(num_sessions)
    rate = check_rate(rate)
    if slo is not None and not isinstance(slo, SLO):
        raise WorkloadError(f"slo must be an SLO or None, got {slo!r}")
    cal = _calibrate(spec)
    r_arr, r_rounds, r_in, r_out, r_tool = _streams(spec.name, seed, 5)

    arrivals = poisson_arrivals(n, rate, r_arr).tolist()
    if spec.rounds_dist == "fixed":
        rounds = np.full(n, int(spec.mean_rounds), dtype=np.int64)
    elif spec.rounds_dist == "poisson":
        rounds = np.minimum(1 + r_rounds.poisson(cal.rounds_param, n), spec.max_rounds)
    else:
        k = spec.rounds_shape
        rounds = np.minimum(1 + r_rounds.negative_binomial(k, k / (k + cal.rounds_param), n), spec.max_rounds)
    total = int(rounds.sum())
    starts = np.concatenate(([0], np.cumsum(rounds)[:-1]))
    first = np.zeros(total, dtype=bool)
    first[starts] = True
    last = np.zeros(total, dtype=bool)
    last[starts + rounds - 1] = True

    mu_in = np.where(first, cal.mu_input_first, cal.mu_input_later)
    inputs = _lognormal_ints(r_in, mu_in, spec.input_sigma, spec.input_max, total).tolist()
    outputs = _lognormal_ints(r_out, cal.mu_output, spec.output_sigma, spec.output_max, total).tolist()
    tool = np.exp(math.log(spec.tool_median_s) + spec.tool_sigma * r_tool.standard_normal(total))
    tool = np.round(np.clip(tool, spec.tool_min_s, spec.tool_max_s), 6)
    tool[last] = 0.0
    tools = tool.tolist()

    sessions = []
    pos = 0
    for i, (t, nr) in enumerate(zip(arrivals, rounds.tolist())):
        rs = [Round(inputs[j], outputs[j], tools[j]) for j in range(pos, pos + nr)]
        pos += nr
        sessions.append(Session(f"{spec.name}-{i}", t, rs, slo))
    return sessions


def agentic_long(num_sessions: int, seed: int, rate: float = 0.1, slo: SLO | None = None,
                 spec: AgenticLongSpec = AGENTIC_LONG) -> list[Session]:
    """Stress sessions of 100-400 rounds, contexts up to ~200K tokens, tool gaps from seconds to hours."""
    n = _check_count(num_sessions)
    rate = check_rate(rate)
    r_arr, r_rounds, r_budget, r_in, r_out, r_tool = _streams("agentic-long", seed, 6)
    arrivals = poisson_arrivals(n, rate, r_arr).tolist()
    rounds = r_rounds.integers(spec.min_rounds, spec.max_rounds + 1, n)
    budgets = r_budget.integers(spec.context_min_tokens, spec.context_max_tokens + 1, n)
    total = int(rounds.sum())
    starts = np.concatenate(([0], np.cumsum(rounds)[:-1]))
    first = np.zeros(total, dtype=bool)
    first[starts] = True
    mu_in = np.where(first, math.log(spec.first_input_median), math.log(spec.input_median))
    sig_in = np.where(first, spec.first_input_sigma, spec.input_sigma)
    inputs = np.maximum(np.exp(mu_in + sig_in * r_in.standard_normal(total)), 1.0)
    outputs = np.clip(np.exp(math.log(spec.output_median) + spec.output_sigma * r_out.standard_normal(total)),
                      1.0, spec.output_max)
    log_lo, log_hi = math.log(spec.tool_min_s), math.log(spec.tool_max_s)
    tools = np.round(np.exp(r_tool.uniform(log_lo, log_hi, total)), 3)

    sessions = []
    for i in range(n):
        a, b = int(starts[i]), int(starts[i] + rounds[i])
        inp, out = inputs[a:b].copy(), outputs[a:b].copy()
        inp[0] = min(inp[0], budgets[i] / 4)
        raw = inp.sum() + out.sum()
        if raw > budgets[i]:  # scale every round after the first so the context ends within budget
            scale = (budgets[i] - inp[0]) / (raw - inp[0])
            inp[1:] *= scale
            out *= scale
        inp_i = np.maximum(np.floor(inp), 1).astype(np.int64).tolist()
        out_i = np.maximum(np.floor(out), 1).astype(np.int64).tolist()
        gaps = tools[a:b].tolist()
        gaps[-1] = 0.0
        rs = [Round(x, y, g) for x, y, g in zip(inp_i, out_i, gaps)]
        sessions.append(Session(f"agentic-long-{i}", arrivals[i], rs, slo))
    return sessions


# --------------------------------------------------------------------------- chat-multiturn


def short_fraction(mu: float, sigma: float, short_tokens: int) -> float:
    """P(clip(rint(exp(mu + sigma Z)), 1, hi) < short_tokens) = P(exp(mu + sigma Z) < short_tokens - 0.5), hi >= it."""
    from scipy import special

    return float(special.ndtr((math.log(short_tokens - 0.5) - mu) / sigma))


def mu_for_short_fraction(fraction: float, sigma: float, short_tokens: int) -> float:
    """The mu whose clipped, rounded lognormal (sigma) is below `short_tokens` with probability `fraction`."""
    from scipy import special

    return math.log(short_tokens - 0.5) - sigma * float(special.ndtri(fraction))


@dataclass(frozen=True, slots=True)
class ChatCalibration:
    """What `chat-multiturn` draws from: the solved parameters and the ShareGPT pools (sorted, read-only)."""

    rounds_param: float       # mean of N in rounds = min(1 + N, max_rounds)
    mu_later: float           # mu of the later rounds' lognormal
    first_short: np.ndarray   # ShareGPT num_prefill_tokens < short_tokens
    first_long: np.ndarray    # ShareGPT num_prefill_tokens >= short_tokens
    outputs: np.ndarray       # ShareGPT num_decode_tokens
    lengths_file: str


def chat_calibration(spec: ChatSpec = CHAT) -> ChatCalibration:
    """Solve `spec`'s parameters and read its ShareGPT pools (WorkloadError if the file lacks a part).

    P(round 0 < short) = first_short_fraction exactly (the weight of the short pool); P(later input < short)
    = later_short_fraction exactly (mu = log(short - 0.5) - sigma * Phi^-1(fraction)); E[rounds] = mean_rounds
    exactly (the capped negative binomial, as for the AMPD workloads)."""
    path = sharegpt_file(spec.lengths_file)
    prefill, decode = sharegpt_lengths(path)
    return _chat_pools(spec, str(path), prefill, decode)


def _chat_pools(spec: ChatSpec, path: str, prefill: np.ndarray, decode: np.ndarray) -> ChatCalibration:
    short = np.sort(prefill[prefill < spec.short_tokens])
    long_ = np.sort(prefill[prefill >= spec.short_tokens])
    for part, what in ((short, "below"), (long_, "at or above")):
        if part.size == 0:
            raise WorkloadError(f"{path}: no num_prefill_tokens {what} {spec.short_tokens}; chat-multiturn "
                                "resamples first prompts from both sides")
    pools = []
    for a in (short, long_, np.sort(decode)):
        a.setflags(write=False)
        pools.append(a)
    return ChatCalibration(
        rounds_param_for_mean("negbin", spec.mean_rounds, spec.rounds_shape, spec.max_rounds),
        mu_for_short_fraction(spec.later_short_fraction, spec.later_input_sigma, spec.short_tokens),
        *pools, path)


def _pick(pool: np.ndarray, u: np.ndarray) -> np.ndarray:
    """pool[floor(u * len(pool))]: a uniform draw over the pool's entries (inverse CDF of the sorted pool)."""
    return pool[np.minimum((u * pool.size).astype(np.int64), pool.size - 1)]


def chat_multiturn(num_sessions: int, seed: int, rate: float = 1.0, slo: SLO | None = None,
                   spec: ChatSpec = CHAT) -> list[Session]:
    """Multi-turn chat sessions with LAPS's length mix (63% / 81% short first / later prompts, ShareGPT's long
    prompts and outputs), Poisson arrivals at `rate`/s; deterministic per seed (and ShareGPT file)."""
    n = _check_count(num_sessions)
    rate = check_rate(rate)
    if slo is not None and not isinstance(slo, SLO):
        raise WorkloadError(f"slo must be an SLO or None, got {slo!r}")
    cal = chat_calibration(spec)
    r_arr, r_rounds, r_first, r_in, r_out, r_think = _streams(spec.name, seed, 6)

    arrivals = poisson_arrivals(n, rate, r_arr).tolist()
    k = spec.rounds_shape
    rounds = np.minimum(1 + r_rounds.negative_binomial(k, k / (k + cal.rounds_param), n), spec.max_rounds)
    total = int(rounds.sum())
    starts = np.concatenate(([0], np.cumsum(rounds)[:-1]))
    last = starts + rounds - 1

    u = r_first.random((n, 2))                # per session: which part, then where in it
    first = np.where(u[:, 0] < spec.first_short_fraction, _pick(cal.first_short, u[:, 1]),
                     _pick(cal.first_long, u[:, 1]))
    inputs = _lognormal_ints(r_in, cal.mu_later, spec.later_input_sigma, spec.later_input_max, total)
    inputs[starts] = first                    # the draws at round 0 positions are not used
    outputs = _pick(cal.outputs, r_out.random(total))
    think = np.exp(math.log(spec.think_median_s) + spec.think_sigma * r_think.standard_normal(total))
    think = np.round(np.clip(think, spec.think_min_s, spec.think_max_s), 3)
    think[last] = 0.0

    ins, outs, gaps = inputs.tolist(), outputs.tolist(), think.tolist()
    sessions = []
    for i, (t, a, nr) in enumerate(zip(arrivals, starts.tolist(), rounds.tolist())):
        rs = [Round(ins[j], outs[j], gaps[j]) for j in range(a, a + nr)]
        sessions.append(Session(f"{spec.name}-{i}", t, rs, slo))
    return sessions
