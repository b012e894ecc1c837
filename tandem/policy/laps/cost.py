"""LAPS §2.1 latency model T(L, H) = αL(L+2H) + βL + γ_w L + γ_r H and its compute/memory boundaries.

L is the number of new (query) tokens of a (re-)prefill, H the number of history tokens whose KV it
reads; every time is in seconds. The compute term αL(L+2H) + βL counts incremental causal attention
(α) and the per-token linear layers (β); the memory term γ_w L + γ_r H counts the KV written for the
new tokens and the history KV read. A (re-)prefill is memory-bound while T_mem > T_comp, i.e. for
L below the boundary L_m where the two terms are equal.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from tandem.perf.nonneg import nonneg_lstsq
from tandem.policy.checks import check_finite

__all__ = ["PrefillCostModel", "boundary_from_profile"]


def _check_lh(L: float, H: float) -> None:
    check_finite("L (new tokens)", L, 0)
    check_finite("H (history tokens)", H, 0)


def _nnls_scaled(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Non-negative least squares with unit-norm columns (the columns span many orders of magnitude)."""
    norms = np.linalg.norm(a, axis=0)
    x, _ = nonneg_lstsq(a / norms, b)
    return x / norms


# α counts as 0 when its term explains less than this fraction of the largest measured time
# (NNLS returns round-off such as 1e-23 rather than an exact 0 for purely linear data).
_ALPHA_ZERO = 1e-9


def _alpha_is_zero(alpha: float, quad: np.ndarray, times: np.ndarray) -> bool:
    return alpha * float(quad.max()) <= _ALPHA_ZERO * float(times.max())


def _require_rank(a: np.ndarray, names: str) -> None:
    norms = np.linalg.norm(a, axis=0)
    if not np.all(norms > 0) or np.linalg.matrix_rank(a / norms) < a.shape[1]:
        raise ValueError(f"samples do not identify {names}: their (L, H) values are degenerate "
                         f"(e.g. all H = 0, or a single L per H); sample more varied shapes")


def _rows(samples: Iterable[Sequence[float]], width: int, what: str) -> np.ndarray:
    rows = [tuple(s) for s in samples]
    for r in rows:
        if len(r) != width:
            raise ValueError(f"each sample must be a {what} tuple of {width} numbers, got {r!r}")
        for name, v in zip(what.strip("()").split(", "), r):
            check_finite(f"sample {name}", v, 0)
    return np.asarray(rows, dtype=float).reshape(len(rows), width)


@dataclass(frozen=True, slots=True)
class PrefillCostModel:
    """LAPS latency model of one (re-)prefill: T(L, H) = αL(L+2H) + βL + γ_w L + γ_r H seconds."""

    alpha: float    # s per unit of L(L+2H): incremental causal attention
    beta: float     # s per new token: linear layers (QKV/O projections, FFN)
    gamma_w: float  # s per new token: KV written
    gamma_r: float  # s per history token: KV read

    def __post_init__(self) -> None:
        for name in ("alpha", "beta", "gamma_w", "gamma_r"):
            check_finite(name, getattr(self, name), 0)
        if self.alpha <= 0:
            raise ValueError(f"alpha must be > 0 (the boundaries divide by it), got {self.alpha!r}")

    # --- latency -------------------------------------------------------------------------------
    def t_comp(self, L: float, H: float = 0.0) -> float:
        """Compute time αL(L+2H) + βL of L new tokens over H history tokens."""
        _check_lh(L, H)
        return self.alpha * L * (L + 2 * H) + self.beta * L

    def t_mem(self, L: float, H: float = 0.0) -> float:
        """KV I/O time γ_w L + γ_r H of L new tokens over H history tokens."""
        _check_lh(L, H)
        return self.gamma_w * L + self.gamma_r * H

    def latency(self, L: float, H: float = 0.0) -> float:
        """Total time T(L, H) = T_comp + T_mem."""
        return self.t_comp(L, H) + self.t_mem(L, H)

    # --- boundaries ----------------------------------------------------------------------------
    def prefill_boundary(self) -> float:
        """L_m^prefill = max(0, (γ_w − β)/α): first-turn prefills with fewer new tokens are memory-bound."""
        return max(0.0, (self.gamma_w - self.beta) / self.alpha)

    def reprefill_boundary(self, H: float) -> float:
        """L_m^re-prefill(H): the positive root of αL² + (2αH + β − γ_w)L − γ_r H = 0 (T_comp = T_mem).

        Equals prefill_boundary() at H = 0 and tends to γ_r/(2α) as H grows. The root is computed in
        the cancellation-free form 2γ_r H / (b + √(b² + 4αγ_r H)) when b = 2αH + β − γ_w > 0.
        """
        check_finite("H (history tokens)", H, 0)
        if H == 0:
            return self.prefill_boundary()
        a = self.alpha
        b = 2 * a * H + self.beta - self.gamma_w
        c = self.gamma_r * H
        root = math.sqrt(b * b + 4 * a * c)
        if b > 0:
            return max(0.0, 2 * c / (b + root))
        return max(0.0, (root - b) / (2 * a))

    # --- construction --------------------------------------------------------------------------
    @classmethod
    def fit(cls, samples: Iterable[Sequence[float]]) -> PrefillCostModel:
        """Fit α, β to T_comp and γ_w, γ_r to T_mem from (L, H, t_comp_s, t_mem_s) samples (LAPS §2.1).

        Two non-negative least-squares fits: t_comp = α·L(L+2H) + β·L and t_mem = γ_w·L + γ_r·H.
        Raises ValueError with fewer samples than the 2 unknowns of each fit, when the samples do not
        identify the coefficients (e.g. every H = 0 leaves γ_r unknown), or when α comes out 0 (its
        term explains under 1e-9 of the largest compute time: round-off, not a quadratic cost).
        """
        x = _rows(samples, 4, "(L, H, t_comp_s, t_mem_s)")
        if len(x) < 2:
            raise ValueError(f"fit needs at least 2 samples (2 unknowns per term), got {len(x)}")
        L, H, tc, tm = x.T
        a_comp = np.column_stack([L * (L + 2 * H), L])
        a_mem = np.column_stack([L, H])
        _require_rank(a_comp, "alpha and beta")
        _require_rank(a_mem, "gamma_w and gamma_r")
        alpha, beta = _nnls_scaled(a_comp, tc)
        gamma_w, gamma_r = _nnls_scaled(a_mem, tm)
        if _alpha_is_zero(alpha, a_comp[:, 0], tc):
            raise ValueError("fitted alpha is 0: the compute times show no quadratic term; "
                             "sample longer L or check the measurements")
        return cls(float(alpha), float(beta), float(gamma_w), float(gamma_r))

    @classmethod
    def fit_total(cls, samples: Iterable[Sequence[float]], gamma_w: float) -> PrefillCostModel:
        """Fit α, β, γ_r from (L, H, total_s) samples with the KV write cost γ_w given.

        From total time alone only β + γ_w is identifiable (both multiply L), so γ_w must come from
        elsewhere — bytes of KV per token / memory bandwidth, e.g. a roofline. NNLS fits
        total = α·L(L+2H) + (β+γ_w)·L + γ_r·H and β = max(0, fitted(β+γ_w) − γ_w). Raises ValueError
        with fewer than 3 samples, degenerate samples, or α fitted as 0.
        """
        check_finite("gamma_w", gamma_w, 0)
        x = _rows(samples, 3, "(L, H, total_s)")
        if len(x) < 3:
            raise ValueError(f"fit_total needs at least 3 samples (3 unknowns), got {len(x)}")
        L, H, tt = x.T
        a = np.column_stack([L * (L + 2 * H), L, H])
        _require_rank(a, "alpha, beta + gamma_w and gamma_r")
        alpha, lin, gamma_r = _nnls_scaled(a, tt)
        if _alpha_is_zero(alpha, a[:, 0], tt):
            raise ValueError("fitted alpha is 0: the times show no quadratic term; "
                             "sample longer L or check the measurements")
        return cls(float(alpha), max(0.0, float(lin) - gamma_w), float(gamma_w), float(gamma_r))

    @classmethod
    def from_profile(cls, measurements: Iterable[dict], kv_bytes_per_token: float,
                     memory_bandwidth_bytes_per_s: float) -> PrefillCostModel:
        """LAPS §2.1 fitted to a `tandem profile`: its single-chunk prefill steps as (L, H, seconds) samples, with
        γ_w = KV bytes per token / the device's measured memory bandwidth (fit_total). ValueError when the profile
        has too few or too uniform prefill steps, or no bandwidth."""
        rows = [m for m in measurements
                if m.get("kind") == "prefill" and m.get("num_prefill") == 1 and m.get("num_decode", 0) == 0]
        samples = [(float(m["prefill_tokens"]), float(m["prefill_kv_read_tokens"]), float(m["seconds"])) for m in rows]
        check_finite("memory_bandwidth_bytes_per_s", memory_bandwidth_bytes_per_s, 0)
        if memory_bandwidth_bytes_per_s <= 0:
            raise ValueError("the profile has no measured memory bandwidth (profile again with this version)")
        return cls.fit_total(samples, kv_bytes_per_token / memory_bandwidth_bytes_per_s)

    @classmethod
    def from_roofline(cls, flops_per_token: float, attn_flops_per_token_pair: float, kv_bytes_per_token: float,
                      peak_flops: float, mem_bw: float) -> PrefillCostModel:
        """Coefficients from a roofline: each term runs at peak compute or at full memory bandwidth.

        - flops_per_token: linear-layer FLOPs of one token (2 per weight; ModelSpec.body_flops_per_token),
          so β = flops_per_token / peak_flops.
        - attn_flops_per_token_pair: attention FLOPs of one (query, key) pair over all layers and heads
          (QKᵀ and PV: 4·layers·heads·head_dim; ModelSpec.attn_flops_per_pair). L new tokens over H
          history attend causally to L·H + L(L+1)/2 ≈ L(L+2H)/2 pairs, so
          α = attn_flops_per_token_pair / (2·peak_flops) — the factor 1/2 maps pairs onto L(L+2H).
        - kv_bytes_per_token: K and V bytes of one token over all layers; writing a new token's KV and
          reading a history token's KV move the same bytes, so γ_w = γ_r = kv_bytes_per_token / mem_bw.

        Weight streaming (weight_bytes / mem_bw per forward) is a per-step constant that T(L, H) has no
        term for, so it is not taken. Note that with KV traffic as the only memory term, γ_w < β for
        common models and the roofline boundary is 0; the 150–512-token boundaries the paper observes
        come from weight streaming and launch overheads, which is why LAPS fits the coefficients to
        measurements (fit / fit_total) rather than trusting this derivation.
        """
        for name, v in (("flops_per_token", flops_per_token),
                        ("attn_flops_per_token_pair", attn_flops_per_token_pair),
                        ("kv_bytes_per_token", kv_bytes_per_token)):
            check_finite(name, v, 0)
        for name, v in (("peak_flops", peak_flops), ("mem_bw", mem_bw)):
            check_finite(name, v, 0)
            if v <= 0:
                raise ValueError(f"{name} must be > 0, got {v!r}")
        kv = kv_bytes_per_token / mem_bw
        return cls(alpha=attn_flops_per_token_pair / (2 * peak_flops), beta=flops_per_token / peak_flops,
                   gamma_w=kv, gamma_r=kv)


def boundary_from_profile(prof) -> int | None:
    """LAPS's L_m^prefill fitted to a `tandem profile` (PrefillCostModel.from_profile), rounded up: the class
    threshold a shell on that profile defaults to; None when it cannot be fitted or is below one token."""
    try:
        m = PrefillCostModel.from_profile(prof.measurements, prof.kv_bytes_per_token,
                                          float(prof.device.get("memory_bandwidth_bytes_per_s") or 0.0))
    except ValueError:
        return None
    lm = math.ceil(m.prefill_boundary())
    return lm if lm >= 1 else None
