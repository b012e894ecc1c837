"""LAPS policies: cost model and boundaries, classifier, graph buckets, AWD batching (Alg. 1), pool controller (Alg. 2)."""
import math
import random

import numpy as np
import pytest

from tandem.policy.laps import (
    DEFAULT_THRESHOLD,
    AWDBatcher,
    AWDConfig,
    Bucket,
    BucketGrid,
    DispatchReason,
    InstanceSignal,
    LengthClassifier,
    Move,
    PoolController,
    PrefillClass,
    PrefillCostModel,
    PressureConfig,
    ShortRequest,
    exceeds,
)

SHORT, LONG = PrefillClass.SHORT, PrefillClass.LONG
M = PrefillCostModel(alpha=1e-6, beta=2e-4, gamma_w=5e-4, gamma_r=1e-5)


# --- cost model -------------------------------------------------------------------------------

def test_latency_terms_match_the_formula():
    """T(L,H) = αL(L+2H) + βL + γ_w L + γ_r H, split into compute and memory as in §2.1."""
    # L=100, H=50: comp = 1e-6*100*200 + 2e-4*100 = 0.02 + 0.02; mem = 5e-4*100 + 1e-5*50 = 0.05 + 0.0005
    assert M.t_comp(100, 50) == pytest.approx(0.04, rel=1e-12)
    assert M.t_mem(100, 50) == pytest.approx(0.0505, rel=1e-12)
    assert M.latency(100, 50) == pytest.approx(0.0905, rel=1e-12)


def test_prefill_boundary_hand_value():
    """L_m^prefill = (γ_w − β)/α = (5e-4 − 2e-4)/1e-6 = 300, and 0 when β >= γ_w (always compute-bound)."""
    assert M.prefill_boundary() == pytest.approx(300.0, rel=1e-12)
    assert M.t_comp(300) == pytest.approx(M.t_mem(300), rel=1e-12)
    assert PrefillCostModel(1e-6, 6e-4, 5e-4, 1e-5).prefill_boundary() == 0.0


def test_reprefill_boundary_hand_value_and_limits():
    """L_m^re-prefill(H): hand value at H=1000, equal to L_m^prefill at H=0, saturating at γ_r/(2α)."""
    # H=1000: b = 2αH + β − γ_w = 2e-3 + 2e-4 − 5e-4 = 1.7e-3; 4αγ_rH = 4e-8;
    # L = (−1.7e-3 + sqrt(2.89e-6 + 4e-8)) / 2e-6 = 500 (sqrt(2.93) − 1.7) = 5.862138431184...
    assert M.reprefill_boundary(1000) == pytest.approx(500 * (math.sqrt(2.93) - 1.7), rel=1e-9)
    assert M.reprefill_boundary(1000) == pytest.approx(5.862138431184, rel=1e-9)
    assert M.t_comp(M.reprefill_boundary(1000), 1000) == pytest.approx(M.t_mem(M.reprefill_boundary(1000), 1000),
                                                                       rel=1e-9)
    assert M.reprefill_boundary(0) == M.prefill_boundary()
    assert M.reprefill_boundary(1e-9) == pytest.approx(300.0, rel=1e-6)   # continuous at H -> 0
    assert M.reprefill_boundary(1e9) == pytest.approx(1e-5 / 2e-6, rel=1e-6)  # γ_r/(2α) = 5; no cancellation


def test_fit_recovers_known_coefficients():
    """fit() recovers α, β, γ_w, γ_r from noiseless (L, H, t_comp, t_mem) samples within 1e-9 relative."""
    samples = [(L, H, M.t_comp(L, H), M.t_mem(L, H)) for L in (8, 64, 300, 2048) for H in (0, 500, 8000)]
    fit = PrefillCostModel.fit(samples)
    for name in ("alpha", "beta", "gamma_w", "gamma_r"):
        assert getattr(fit, name) == pytest.approx(getattr(M, name), rel=1e-9), name


def test_fit_errors():
    """fit() refuses too few samples, samples that leave a coefficient unidentified, and α = 0."""
    with pytest.raises(ValueError, match="at least 2"):
        PrefillCostModel.fit([(8, 10, 1.0, 1.0)])
    with pytest.raises(ValueError, match="gamma_w and gamma_r"):   # H always 0: γ_r unidentifiable
        PrefillCostModel.fit([(L, 0, M.t_comp(L, 0), M.t_mem(L, 0)) for L in (8, 64, 512)])
    with pytest.raises(ValueError, match="alpha is 0"):            # purely linear compute times
        PrefillCostModel.fit([(L, H, 1e-4 * L, M.t_mem(L, H)) for L in (8, 64, 512) for H in (0, 100)])
    with pytest.raises(ValueError, match="4 numbers"):
        PrefillCostModel.fit([(8, 10, 1.0)])
    with pytest.raises(ValueError, match="alpha must be > 0"):
        PrefillCostModel(0.0, 1.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="gamma_r"):
        PrefillCostModel(1.0, 1.0, 1.0, -1.0)


def test_fit_total_with_known_gamma_w():
    """From total time only β+γ_w is identifiable: fit_total fixes γ_w and recovers α, β, γ_r."""
    samples = [(L, H, M.latency(L, H)) for L in (8, 64, 300, 2048) for H in (0, 500, 8000)]
    fit = PrefillCostModel.fit_total(samples, gamma_w=5e-4)
    for name in ("alpha", "beta", "gamma_w", "gamma_r"):
        assert getattr(fit, name) == pytest.approx(getattr(M, name), rel=1e-9), name
    # a γ_w larger than the fitted β+γ_w (7e-4) clips β at 0
    assert PrefillCostModel.fit_total(samples, gamma_w=1e-3).beta == 0.0
    with pytest.raises(ValueError, match="at least 3"):
        PrefillCostModel.fit_total(samples[:2], gamma_w=5e-4)


def test_from_roofline_derivation():
    """Roofline: β = flops/peak, α = pair flops/(2·peak) (causal pairs ≈ L(L+2H)/2), γ_w = γ_r = kv bytes/bw."""
    m = PrefillCostModel.from_roofline(flops_per_token=2e9, attn_flops_per_token_pair=4e5,
                                       kv_bytes_per_token=1e5, peak_flops=1e15, mem_bw=2e12)
    assert m.beta == pytest.approx(2e-6) and m.alpha == pytest.approx(2e-10)
    assert m.gamma_w == m.gamma_r == pytest.approx(5e-8)
    with pytest.raises(ValueError, match="mem_bw"):
        PrefillCostModel.from_roofline(1.0, 1.0, 1.0, 1.0, 0.0)


# --- classifier -------------------------------------------------------------------------------

def test_classifier_threshold():
    """SHORT strictly below the threshold; LAPS's default threshold is 256."""
    c = LengthClassifier()
    assert c.threshold == DEFAULT_THRESHOLD == 256
    assert c.classify(255) is SHORT and c.classify(256) is LONG and c.classify(10, history_tokens=5000) is SHORT
    with pytest.raises(ValueError, match="threshold"):
        LengthClassifier(0)
    with pytest.raises(ValueError, match="new_tokens"):
        c.classify(-1)


# --- buckets ----------------------------------------------------------------------------------

G = BucketGrid()


def test_nearest_graph_choices():
    """NearestGraph picks the smallest length and batch holding the batch."""
    assert G.nearest([5]) == Bucket(8, 1)
    assert G.nearest([8, 9, 3]) == Bucket(16, 4)
    assert G.nearest([256] * 64) == Bucket(256, 64)
    assert G.nearest([257]) is None                  # longer than any captured length
    assert G.nearest([1] * 65) is None               # more requests than any captured batch


def test_nearest_graph_respects_the_memory_budget():
    """A bucket whose padded tokens exceed the budget is excluded (the standard kernel is used)."""
    assert G.nearest([10, 12, 16], mem_budget_tokens=64) == Bucket(16, 4)
    assert G.nearest([10, 12, 16], mem_budget_tokens=63) is None


def test_max_depth():
    """Alg. 1's initial D: the largest captured batch with some bucket (L >= length, B) within the budget."""
    assert G.max_depth(None) == 64
    assert G.max_depth(100) == 8          # 8 tokens x 8 = 64 <= 100 < 8 x 16
    assert G.max_depth(100, length=20) == 2   # 32 x 2 = 64
    assert G.max_depth(7) == 0
    assert G.max_depth(None, length=300) == 0


def test_grid_validation():
    """Grid axes must be non-empty, strictly increasing positive ints."""
    with pytest.raises(ValueError, match="strictly increasing"):
        BucketGrid(lengths=(8, 8, 16))
    with pytest.raises(ValueError, match="batches"):
        BucketGrid(batches=())
    with pytest.raises(ValueError, match="lengths"):
        BucketGrid(lengths=(0, 8))


# --- AWD --------------------------------------------------------------------------------------

def const(s):
    return lambda lengths: s


def req(key, tokens=10, at=0.0, ddl=math.inf):
    return ShortRequest(key, tokens, at, ddl)


def keys(decision):
    return [r.key for r in decision.batch]


def test_awd_depth_reached_dispatches_at_once():
    """Reaching D requests dispatches immediately, in the nearest captured bucket."""
    b = AWDBatcher(AWDConfig(), BucketGrid(batches=(1, 2, 4)), const(0.001))
    assert b.depth_target == 4
    for i in range(3):
        b.on_arrival(req(f"r{i}", 10 + i, 0.001 * i), 0.001 * i)
        assert b.poll(0.001 * i).reason is DispatchReason.WAITING
    b.on_arrival(req("r3", 20, 0.003), 0.003)
    d = b.poll(0.003)
    assert d.reason is DispatchReason.DEPTH_REACHED and keys(d) == ["r0", "r1", "r2", "r3"]
    assert d.bucket == Bucket(32, 4) and len(b) == 0
    assert b.poll(0.003).reason is DispatchReason.EMPTY


def test_awd_never_waits_past_w_max():
    """A lone request with no deadline waits exactly W_max (no rate yet: W_GR is huge) and no longer."""
    b = AWDBatcher(AWDConfig(w_max_s=0.02), BucketGrid(), const(0.001))
    b.on_arrival(req("a"), 1.0)
    d = b.poll(1.0)
    assert d.reason is DispatchReason.WAITING and d.wake_at_s == pytest.approx(1.02)
    assert b.poll(1.0199).reason is DispatchReason.WAITING
    d = b.poll(d.wake_at_s)
    assert d.reason is DispatchReason.WINDOW_EXPIRED and keys(d) == ["a"] and d.bucket == Bucket(16, 1)


def test_awd_head_of_line_t_max():
    """With T_max < W_max, the head is dispatched when it has waited T_max (HEAD_WAIT)."""
    b = AWDBatcher(AWDConfig(w_max_s=0.05, t_max_s=0.01), BucketGrid(), const(0.001))
    b.on_arrival(req("a"), 0.0)
    d = b.poll(0.0)
    assert d.wake_at_s == pytest.approx(0.01)
    assert b.poll(0.01).reason is DispatchReason.HEAD_WAIT


def test_awd_slack_dispatches_before_the_window():
    """SLACK: dispatch at DDL − Ŝ − σ (Ŝ of the batch poll would form), earlier than the window."""
    # Ŝ = 1 ms per request; a (no deadline) and b (deadline 0.012): batch {a, b}, Ŝ = 2 ms, σ = 5 ms
    b = AWDBatcher(AWDConfig(w_max_s=0.02, sigma_s=0.005), BucketGrid(), lambda ls: 0.001 * len(ls))
    b.on_arrival(req("a", at=0.0), 0.0)
    b.on_arrival(req("b", at=0.001, ddl=0.012), 0.001)
    d = b.poll(0.001)
    assert d.reason is DispatchReason.WAITING and d.wake_at_s == 0.012 - 0.002 - 0.005
    d = b.poll(d.wake_at_s)
    assert d.reason is DispatchReason.SLACK and keys(d) == ["a", "b"]


def test_awd_window_formula():
    """window(now) = clip(min(W_SLA, W_GR), [w_min, w_max]) with hand-computed terms and rate estimate."""
    cfg = AWDConfig(w_min_s=0.001, w_max_s=10.0, delta_s=0.002, rate_halflife_s=1.0)
    b = AWDBatcher(cfg, BucketGrid(batches=(1, 2, 4, 8)), const(0.004))
    lam = math.log(2)
    for i, t in enumerate((0.0, 0.5, 1.0)):
        b.on_arrival(req(f"r{i}", at=t), t)
    r = lam * (math.exp(-lam * 1.0) + math.exp(-lam * 0.5) + 1.0)
    assert b.rate(1.0) == pytest.approx(r, rel=1e-12)
    assert b.rate(2.0) == pytest.approx(r / 2, rel=1e-12)           # halves per half-life
    # D = 8, depth 3: W_GR = (8 − 3) / r = 3.27 s (no deadline: W_SLA = inf)
    assert b.window(1.0) == pytest.approx(5 / r, rel=1e-12)
    assert b.close_at_s == 0.0 + 10.0            # the head's batch was made current at 0.0: W_GR = 7/ln 2 -> w_max
    # a deadline at 1.03: W_SLA = 1.03 − 1.0 − 0.004 − 0.002 = 0.024
    b.on_arrival(req("r3", at=1.0, ddl=1.03), 1.0)
    assert b.window(1.0) == pytest.approx(0.024, abs=1e-12)
    assert b.window(1.029) == pytest.approx(0.001)                  # W_SLA = 0 -> clipped to w_min


def test_awd_adapts_w_and_d_after_dispatch():
    """Alg. 1: d >= D sets W = clip(τ) (and probes D one captured size up); d < D sets D = d (>= 1, <= cap)."""
    b = AWDBatcher(AWDConfig(w_min_s=0.001, w_max_s=0.02), BucketGrid(batches=(1, 2, 4, 8)), const(0.001),
                   mem_budget_tokens=8 * 4)
    assert b.depth_cap == 4 and b.depth_target == 4        # 8 tokens x 4 = 32 fits; x 8 does not
    b.on_dispatch(3, 0.004)
    assert b.depth_target == 3 and b.learned_window_s == 0.02     # d < D: only D changes
    b.on_dispatch(3, 0.004)
    assert b.depth_target == 4 and b.learned_window_s == 0.004    # d >= D: W = τ, D -> next captured (4)
    b.on_dispatch(4, 0.5)
    assert b.depth_target == 4 and b.learned_window_s == 0.02     # cap holds; τ clipped to w_max
    b.on_dispatch(4, 0.0)
    assert b.learned_window_s == 0.001                            # clipped to w_min
    b.set_mem_budget(8 * 2)
    assert b.depth_cap == 2 and b.depth_target == 2
    b.on_dispatch(1, 0.0)
    assert b.depth_target == 1


def test_awd_poll_feeds_the_adaptation():
    """A window-expired batch of 2 < D lowers D to 2; the next batch then fills at depth 2 at once."""
    b = AWDBatcher(AWDConfig(w_max_s=0.02), BucketGrid(batches=(1, 2, 4, 8)), const(0.001))
    b.on_arrival(req("a", at=0.0), 0.0)
    b.on_arrival(req("b", at=0.005), 0.005)
    d = b.poll(0.02)
    assert d.reason is DispatchReason.WINDOW_EXPIRED and keys(d) == ["a", "b"] and b.depth_target == 2
    b.on_arrival(req("c", at=0.1), 0.1)
    b.on_arrival(req("d", at=0.103), 0.103)
    d = b.poll(0.103)
    assert d.reason is DispatchReason.DEPTH_REACHED and keys(d) == ["c", "d"]
    assert b.learned_window_s == pytest.approx(0.003) and b.depth_target == 4


def test_awd_token_target_mode():
    """Deadline-free token-max mode: dispatch once the batch's real tokens reach token_target."""
    b = AWDBatcher(AWDConfig(token_target=100), BucketGrid(), const(0.001))
    b.on_arrival(req("a", 40), 0.0)
    b.on_arrival(req("b", 40), 0.001)
    assert b.poll(0.001).reason is DispatchReason.WAITING
    b.on_arrival(req("c", 30), 0.002)
    d = b.poll(0.002)
    assert d.reason is DispatchReason.TOKEN_TARGET and keys(d) == ["a", "b", "c"] and d.bucket == Bucket(64, 4)


def test_awd_bucket_first_formation():
    """The head goes first, then same-bucket requests, then the nearer (shorter on ties) bucket; never > D."""
    b = AWDBatcher(AWDConfig(), BucketGrid(batches=(1, 2, 4)), const(0.001))
    for k, n in (("h", 10), ("long", 200), ("tiny", 5), ("same", 12), ("mid", 30)):
        b.on_arrival(req(k, n), 0.0)
    # buckets: h 16 (idx 1); long 256 (5); tiny 8 (0); same 16 (1); mid 32 (2). D = 4.
    d = b.poll(0.0)
    assert d.reason is DispatchReason.DEPTH_REACHED and keys(d) == ["h", "same", "tiny", "mid"]
    assert d.bucket == Bucket(32, 4)
    assert [r.key for r in b.queued] == ["long"]


def test_awd_memory_budget_marks_the_batch_full():
    """A queued request that does not fit the token budget is skipped and the batch dispatches at once."""
    b = AWDBatcher(AWDConfig(), BucketGrid(), const(0.001), mem_budget_tokens=64)
    b.on_arrival(req("a", 40), 0.0)
    b.on_arrival(req("b", 30), 0.0)
    d = b.poll(0.0)
    assert d.reason is DispatchReason.DEPTH_REACHED and keys(d) == ["a"] and d.bucket == Bucket(64, 1)


def test_awd_validation():
    """Bad configuration, duplicate keys, backwards time and bad estimates are refused with clear errors."""
    with pytest.raises(ValueError, match="w_min_s"):
        AWDConfig(w_min_s=0.1, w_max_s=0.01)
    with pytest.raises(ValueError, match="epsilon_rate"):
        AWDConfig(epsilon_rate=0.0)
    with pytest.raises(ValueError, match="token_target"):
        AWDConfig(token_target=0)
    with pytest.raises(ValueError, match="tokens"):
        ShortRequest("a", 0, 0.0)
    b = AWDBatcher(AWDConfig(), BucketGrid(), const(-1.0))
    b.on_arrival(req("a"), 1.0)
    with pytest.raises(ValueError, match="already queued"):
        b.on_arrival(req("a"), 1.0)
    with pytest.raises(ValueError, match="backwards"):
        b.poll(0.5)
    with pytest.raises(ValueError, match="service_estimate"):
        b.poll(1.0)


def test_awd_cancel_restarts_the_batch_for_the_new_head():
    """Cancelling the head makes the next request the head; its own enqueue time starts the window."""
    b = AWDBatcher(AWDConfig(w_max_s=0.02), BucketGrid(), const(0.001))
    b.on_arrival(req("a"), 0.0)
    b.on_arrival(req("b"), 0.01)
    assert b.cancel("a", 0.015) and not b.cancel("zz", 0.015)
    d = b.poll(0.015)
    assert d.reason is DispatchReason.WAITING and d.wake_at_s == pytest.approx(0.03)


def test_awd_property_no_request_held_past_its_bound():
    """Property: polled at every wake_at_s, each request r is dispatched by
    min(max(h_r, e_r + min(w_max, t_max)), max(e_r, DDL_r − Ŝ − σ)) (e_r enqueue, h_r became head, Ŝ constant)."""
    rng = random.Random(20240611)
    S = 0.004
    for cfg in (AWDConfig(), AWDConfig(w_min_s=0.002, w_max_s=0.03, t_max_s=0.015, sigma_s=0.001)):
        b = AWDBatcher(cfg, BucketGrid(), const(S), mem_budget_tokens=2048)
        arrivals, t = [], 0.0
        for i in range(400):
            t += rng.expovariate(300.0) if i % 50 < 40 else rng.expovariate(20.0)   # bursts and lulls
            ddl = math.inf if rng.random() < 0.4 else t + rng.uniform(0.0, 0.06)
            arrivals.append(ShortRequest(f"r{i}", rng.randint(1, 320), t, ddl))
        enq, head_at, sent = {}, {}, {}
        i, wake = 0, None
        while i < len(arrivals) or len(b):
            nxt = arrivals[i].arrival_s if i < len(arrivals) else math.inf
            if wake is not None and wake < nxt:
                now = wake
            else:
                now = nxt
                b.on_arrival(arrivals[i], now)
                enq[arrivals[i].key] = now
                i += 1
            while True:
                if len(b):
                    head_at.setdefault(b.queued[0].key, now)
                d = b.poll(now)
                if not d.dispatched:
                    assert d.wake_at_s is None or d.wake_at_s > now
                    wake = d.wake_at_s
                    break
                assert len(d.batch) <= 64
                for r in d.batch:
                    sent[r.key] = now
        assert len(sent) == len(arrivals)
        cap = min(cfg.w_max_s, cfg.t_max_s)
        for r in arrivals:
            e = enq[r.key]
            h = head_at.get(r.key, sent[r.key])
            bound = min(max(h, e + cap), max(e, r.deadline_s - S - cfg.sigma_s))
            assert sent[r.key] <= bound + 1e-12, (r, e, h, sent[r.key])


# --- pool controller --------------------------------------------------------------------------

def sig(k, q=0.0, e=0.0, u=0.0):
    return InstanceSignal(k, q, e, u)


def signals(*ss):
    return {s.instance: s for s in ss}


def test_pressure_and_pool_pressure():
    """ψ = αq + βe − γu; pool pressure = P90 with numpy.percentile's linear interpolation."""
    c = PoolController(PressureConfig(alpha=2.0, beta=3.0, gamma=4.0), [0], [1])
    assert c.pressure(sig(0, q=1.0, e=0.5, u=0.25)) == 2.0 + 1.5 - 1.0
    ss = [sig(k, q=float(q)) for k, q in enumerate((0, 1, 2, 10))]
    assert c.pool_pressure(ss) == pytest.approx(np.percentile([0, 2, 4, 20], 90))   # 15.2
    assert c.pool_pressure(ss) == pytest.approx(15.2)


def test_controller_moves_one_instance_when_imbalance_exceeds_hysteresis():
    """P_s > (1+τ)P_l moves the least-pressured long instance (ties: lowest id) to the short pool."""
    c = PoolController(PressureConfig(tau=0.2, t_cool_s=5.0), short=[0, 1], long=[2, 3, 4])
    s = signals(sig(0, q=5), sig(1, q=5), sig(2, q=1), sig(3, q=1), sig(4, q=3))
    mv = c.step(10.0, s)
    assert mv == Move(2, LONG, SHORT, 10.0)
    assert c.pools() == {SHORT: frozenset({0, 1, 2}), LONG: frozenset({3, 4})}


def test_controller_holds_within_hysteresis():
    """P_s = 1.19 P_l with τ = 0.2 moves nothing; 1.21 P_l does."""
    c = PoolController(PressureConfig(tau=0.2, t_cool_s=0.0), short=[0], long=[1, 2])
    assert c.step(0.0, signals(sig(0, q=1.19), sig(1, q=1.0), sig(2, q=1.0))) is None
    assert c.step(1.0, signals(sig(0, q=1.21), sig(1, q=1.0), sig(2, q=1.0))) == Move(1, LONG, SHORT, 1.0)


def test_controller_never_moves_within_cool_down():
    """After a move, no move for t_cool_s even under a growing imbalance; the next one comes at t_last + T_cool."""
    c = PoolController(PressureConfig(t_cool_s=5.0), short=[0], long=[1, 2, 3, 4])
    hot = signals(sig(0, q=10), sig(1), sig(2), sig(3), sig(4))
    assert c.step(0.0, hot) is not None
    for t in np.arange(0.5, 5.0, 0.5):
        assert c.step(float(t), hot) is None
    assert c.step(5.0, hot) is not None


def test_controller_never_below_n_min():
    """The donor pool never drops below n_min, whatever the imbalance."""
    c = PoolController(PressureConfig(t_cool_s=0.0, n_min=2), short=[0, 1], long=[2, 3, 4])
    hot = signals(sig(0, q=10), sig(1, q=10), sig(2), sig(3), sig(4))
    moves = [c.step(float(t), hot) for t in range(10)]
    assert sum(m is not None for m in moves) == 1
    assert len(c.pools()[LONG]) == 2
    with pytest.raises(ValueError, match="n_min"):
        PoolController(PressureConfig(n_min=2), short=[0], long=[1, 2])


def test_negative_pressure_hysteresis_rule():
    """Signed rule a − b > τ|b|: with P_l = −1 (no queue, busy GPUs) P_s = −0.79 exceeds it (τ = 0.2) but −0.81
    does not — the paper's literal P_s > (1+τ)P_l = −1.2 would accept both."""
    assert exceeds(-0.79, -1.0, 0.2) and not exceeds(-0.81, -1.0, 0.2)
    assert exceeds(1.21, 1.0, 0.2) and not exceeds(1.19, 1.0, 0.2)
    assert exceeds(0.01, 0.0, 0.2) and not exceeds(0.0, 0.0, 0.2)
    c = PoolController(PressureConfig(t_cool_s=0.0, tau=0.2), short=[0], long=[1, 2])
    assert c.step(0.0, signals(sig(0, u=0.81), sig(1, u=1.0), sig(2, u=1.0))) is None
    assert c.step(1.0, signals(sig(0, u=0.79), sig(1, u=1.0), sig(2, u=1.0))) == Move(1, LONG, SHORT, 1.0)


def test_controller_does_not_oscillate_under_constant_load():
    """Same signals for 100 periods after the first move: exactly one move in total."""
    # P_s = 12 > 1.2 * P90[0, 9.5, 9.5] = 1.2 * 9.5; after moving instance 1: P90[0, 12] = 10.8 < 1.2 * 9.5.
    c = PoolController(PressureConfig(t_cool_s=5.0), short=[0], long=[1, 2, 3])
    s = signals(sig(0, q=12), sig(1), sig(2, q=9.5), sig(3, q=9.5))
    moves = [m for t in range(101) if (m := c.step(float(t), s)) is not None]
    assert moves == [Move(1, LONG, SHORT, 0.0)]
    assert c.pools() == {SHORT: frozenset({0, 1}), LONG: frozenset({2, 3})}


def test_controller_repeated_moves_go_one_way_to_a_fixed_point():
    """When a constant load justifies several moves, they all go the same way and the pools then stay put."""
    c = PoolController(PressureConfig(t_cool_s=5.0), short=[0, 1], long=[2, 3, 4, 5])
    s = signals(sig(0, q=4), sig(1, q=4), sig(2, q=1), sig(3, q=1), sig(4, q=1), sig(5, q=2))
    history = []
    for t in range(101):
        c.step(float(t), s)
        history.append(c.pools())
    moves = [m for m in (c.step(float(t), s) for t in range(101, 201)) if m is not None]
    assert moves == []
    assert history[-1] == history[30] == {SHORT: frozenset({0, 1, 2, 3, 4}), LONG: frozenset({5})}
    sizes = [len(h[SHORT]) for h in history]
    assert sizes == sorted(sizes)                       # the short pool only ever grows: no flip-flop


def test_reversal_guard_prevents_flip_flop():
    """P90 over small pools jumps: without the guard a constant load moves instance 1 back and forth every
    cool-down; with it, no move is made (the move would at once qualify its reverse)."""
    # long: ten idle instances and one with q = 100 -> P90 = 0; short: one instance at q = 1.
    s = signals(sig(0, q=1), *[sig(k) for k in range(1, 11)], sig(11, q=100))
    paper = PoolController(PressureConfig(t_cool_s=5.0, guard_reversal=False), short=[0], long=range(1, 12))
    moves = [m for t in range(0, 30) if (m := paper.step(float(t), s)) is not None]
    assert [(m.instance, m.to_pool) for m in moves[:2]] == [(1, SHORT), (1, LONG)]   # flip-flop
    guarded = PoolController(PressureConfig(t_cool_s=5.0), short=[0], long=range(1, 12))
    assert all(guarded.step(float(t), s) is None for t in range(0, 30))


def test_controller_validation():
    """Overlapping pools, mismatched signal keys and bad config values are refused."""
    with pytest.raises(ValueError, match="both pools"):
        PoolController(PressureConfig(), short=[0, 1], long=[1, 2])
    with pytest.raises(ValueError, match="aggregator_quantile"):
        PressureConfig(aggregator_quantile=1.5)
    c = PoolController(PressureConfig(), short=[0], long=[1])
    with pytest.raises(ValueError, match="signals"):
        c.step(0.0, {0: sig(1), 1: sig(1)})
    assert c.step(0.0, {0: sig(0)}) is None   # no signal from the long pool: no decision


def test_reversal_backoff_damps_the_limit_cycle_of_a_closed_loop():
    """Protects the controller against a load that answers its moves: each pool's backlog is its class's load over
    its size (1.5 short, 6.5 long on 8 instances), so the balance lies between 1 and 2 short instances. Without the
    back-off the pools flip every cool-down (80 moves in 400 s); with it each reversal waits twice as long as the
    last: moves at 0, 5, 10 (one way, plain cool-down), then 20, 40, 80, 160, 320 s."""
    from tandem.policy.laps.classify import PrefillClass as C

    def moves(backoff: float) -> list[tuple[float, str]]:
        c = PoolController(PressureConfig(t_cool_s=5.0, reversal_backoff=backoff), short=[0, 1, 2, 3],
                           long=[4, 5, 6, 7])
        out = []
        for t in range(400):
            pools = c.pools()
            ns, nl = len(pools[C.SHORT]), len(pools[C.LONG])
            sig = {k: InstanceSignal(k, 1.5 / ns if k in pools[C.SHORT] else 6.5 / nl, 0.0, 0.0) for k in range(8)}
            m = c.step(float(t), sig)
            if m is not None:
                out.append((m.at_s, m.to_pool.value))
        return out

    assert len(moves(1.0)) == 80
    assert moves(2.0) == [(0.0, "long"), (5.0, "long"), (10.0, "long"), (20.0, "short"), (40.0, "long"),
                          (80.0, "short"), (160.0, "long"), (320.0, "short")]
    with pytest.raises(ValueError, match="reversal_backoff"):
        PressureConfig(reversal_backoff=0.5)


def test_an_empty_pool_wins_an_instance_back_from_its_class_backlog():
    """Protects n_min 0 with per-class signals: the short pool is empty and both instances serve short prefills in
    the long pool; scored on its class's backlog over every instance (2 s queued each against 0.1 s of long work)
    the empty short pool exceeds the long pool and takes its least pressed instance; without per-class signals an
    empty pool could never be scored above the pool that serves it."""
    from tandem.policy.laps.classify import PrefillClass as C
    c = PoolController(PressureConfig(n_min=0, t_cool_s=5.0), short=[], long=[0, 1])
    total = {k: InstanceSignal(k, 2.1, 0.0, 1.0) for k in (0, 1)}
    by_class = {C.SHORT: {0: InstanceSignal(0, 2.0, 0.0, 1.0), 1: InstanceSignal(1, 2.0, 0.0, 1.0)},
                C.LONG: {0: InstanceSignal(0, 0.1, 0.0, 1.0), 1: InstanceSignal(1, 0.05, 0.0, 1.0)}}
    assert c.step(0.0, total) is None
    m = c.step(1.0, total, by_class)
    assert (m.instance, m.from_pool, m.to_pool) == (1, C.LONG, C.SHORT)
    assert c.pools() == {C.SHORT: frozenset({1}), C.LONG: frozenset({0})}


def _profile_rows(model: PrefillCostModel, shapes) -> list[dict]:
    """`tandem profile` measurement rows of single-chunk prefill steps timed by `model`, plus rows the fit skips."""
    rows = [{"kind": "prefill", "num_prefill": 1, "num_decode": 0, "prefill_tokens": L, "prefill_kv_read_tokens": H,
             "seconds": model.latency(L, H)} for L, H in shapes]
    rows.append({"kind": "prefill", "num_prefill": 2, "num_decode": 0, "prefill_tokens": 64,
                 "prefill_kv_read_tokens": 0, "seconds": 99.0})
    rows.append({"kind": "mixed", "num_prefill": 1, "num_decode": 4, "prefill_tokens": 64,
                 "prefill_kv_read_tokens": 0, "seconds": 99.0})
    return rows


def test_the_boundary_is_fitted_to_a_profiles_prefill_steps():
    """Protects the T(L, H) fit: single-chunk prefill steps timed by a known T(L, H) (alpha 1e-8, beta 1e-6,
    gamma_w = 4096 B / 1e9 B/s, gamma_r 2e-6) give back its coefficients and its boundary (gamma_w − beta)/alpha =
    309.6 tokens; multi-chunk and mixed steps are left out; a profile without bandwidth, or with flat times (an
    engine bound by its kernel launches), says why it cannot be fitted."""
    truth = PrefillCostModel(alpha=1e-8, beta=1e-6, gamma_w=4096 / 1e9, gamma_r=2e-6)
    shapes = [(L, H) for L in (16, 64, 256, 1024) for H in (0, 512, 2048)]
    m = PrefillCostModel.from_profile(_profile_rows(truth, shapes), 4096, 1e9)
    assert m.alpha == pytest.approx(1e-8, rel=1e-6) and m.gamma_r == pytest.approx(2e-6, rel=1e-6)
    assert m.beta == pytest.approx(1e-6, rel=1e-6) and m.gamma_w == 4096 / 1e9
    assert m.prefill_boundary() == pytest.approx(309.6, rel=1e-6)
    with pytest.raises(ValueError, match="bandwidth"):
        PrefillCostModel.from_profile(_profile_rows(truth, shapes), 4096, 0.0)
    flat = [{**r, "seconds": 0.05} for r in _profile_rows(truth, shapes)]
    with pytest.raises(ValueError, match="alpha is 0"):
        PrefillCostModel.from_profile(flat, 4096, 1e9)
