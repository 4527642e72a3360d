"""OTLP solvers: map the k tokens drawn at one node to one output token distributed exactly as p.

Each solver gives two views of the same rule (algorithms.md §1.4, §2, §3.4):
``sample(p, q, draws, rng)`` runs it once, and ``branching(p, q, draws)`` returns the exact probability
that it outputs each drafted token, with its own randomness summed out. Top-down tree verification
(:mod:`decode.verifiers.ot`) calls one of them at every node it reaches.

Vectors ``p`` and ``q`` have shape ``(V,)``; scalar arithmetic runs in Python floats (double precision)
and vector arithmetic in the dtype given (float64 in the exact tests).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from decode.drafting.rng import RandomSource


def as_index(values) -> torch.Tensor:
    """A long index tensor (also for an empty list, which torch would otherwise make float)."""
    return torch.tensor(list(values), dtype=torch.long)


def residual(p: torch.Tensor, q: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Unnormalised ``(scale * p - q)_+``, shape ``(V,)``."""
    return (p * scale - q).clamp_min_(0.0) if scale != 1.0 else (p - q).clamp_min_(0.0)


def normalized(v: torch.Tensor) -> torch.Tensor:
    """``v / sum(v)``; an all-zero vector stays zero (it is then never sampled from)."""
    total = float(v.sum())
    return v / total if total > 0.0 else v


def sample_residual(rng: RandomSource, weights: torch.Tensor, fallback: torch.Tensor) -> int:
    """Sample ``weights``, or ``fallback`` if they have no mass.

    An empty residual is reachable only through rounding, on a branch whose probability is zero in exact
    arithmetic (a weight of 1 - 1e-16 that should be 1); any token is then as right as another, and p at the
    node is the natural one. This keeps a measure-zero event from crashing a decode.
    """
    if float(weights.sum()) > 0.0:
        return rng.categorical(weights)
    return rng.categorical(fallback)


def accept_prob(p_x: float, q_x: float) -> float:
    """``min(1, p/q)`` with 0/0 read as 1 (a token q never draws is never tested)."""
    return 1.0 if p_x >= q_x else p_x / q_x


def _p_of_draw(p_t: float, q_t: float) -> float:
    return p_t


class OTLPSolver:
    """Base class: one rule for turning k i.i.d. draws into one p-distributed token.

    ``single_draw(p_t, q_t)``, when set, is the closed form of P(output = t | the only draw is t): most nodes of a
    delayed tree have one draw, and data collection takes this instead of :meth:`branching`. It is declared by the
    built-in solvers and not inherited: a subclass that changes the rule (a negative control) keeps its own
    ``branching``.
    """

    name: str = ""
    single_draw: Callable[[float, float], float] | None = None

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "single_draw" not in cls.__dict__:
            cls.single_draw = None

    def sample(self, p: torch.Tensor, q: torch.Tensor, draws: list[int], rng: RandomSource) -> int:
        raise NotImplementedError

    def branching(self, p: torch.Tensor, q: torch.Tensor, draws: list[int]) -> dict[int, float]:
        """P(output = t) for each distinct drafted token t."""
        raise NotImplementedError


class NSSSolver(OTLPSolver):
    """Naive speculative sampling: draw from p, ignore q (valid for any tree)."""

    name = "nss"
    single_draw = staticmethod(_p_of_draw)

    def sample(self, p, q, draws, rng):
        return rng.categorical(p)

    def branching(self, p, q, draws):
        values = p[as_index(sorted(set(draws)))].tolist() if draws else []
        return dict(zip(sorted(set(draws)), values, strict=True))


class NaiveSolver(OTLPSolver):
    """Standard speculative sampling on the first draw; the residual sample may land on another draw."""

    name = "naive"
    single_draw = staticmethod(accept_prob)  # one draw: every rule but NSS is standard speculative sampling

    def sample(self, p, q, draws, rng):
        if not draws:
            return rng.categorical(p)
        first = draws[0]
        if rng.bernoulli(accept_prob(float(p[first]), float(q[first]))):
            return first
        return sample_residual(rng, residual(p, q), p)

    def branching(self, p, q, draws):
        first = draws[0]
        a = accept_prob(float(p[first]), float(q[first]))
        r = normalized(residual(p, q))
        distinct = sorted(set(draws))
        out = dict(zip(distinct, ((1.0 - a) * x for x in r[as_index(distinct)].tolist()), strict=True))
        out[first] += a
        return out


class SpecInferSolver(OTLPSolver):
    """Recursive rejection sampling with replacement: one residual update per rejected draw, duplicates kept.

    The draws are tested in draw order rather than in a uniformly random order: for i.i.d. draws the two
    are equal in distribution, and a fixed order makes the branching probabilities O(k) instead of a
    2^k dynamic programme over subsets.
    """

    name = "specinfer"
    single_draw = staticmethod(accept_prob)  # one draw: every rule but NSS is standard speculative sampling

    def _next_draft(self, q_cur: torch.Tensor, rejected: int) -> torch.Tensor:
        """The draft the next draw is tested against: unchanged, since draws are i.i.d. (with replacement)."""
        return q_cur

    def _residual_chain(self, p, q, draws):
        """Yields (token, acceptance probability) for each draw tested, then (None, final p) once all are rejected."""
        p_cur, q_cur = p, q
        for x in draws:
            a = accept_prob(float(p_cur[x]), float(q_cur[x]))
            yield x, a
            if a >= 1.0:
                return
            p_cur = normalized(residual(p_cur, q_cur))
            q_cur = self._next_draft(q_cur, x)
        yield None, p_cur

    def sample(self, p, q, draws, rng):
        for x, value in self._residual_chain(p, q, draws):
            if x is None:  # every draw rejected: value is the final residual p
                return sample_residual(rng, value, p)
            if rng.bernoulli(value):
                return x
        raise AssertionError("unreachable: a draw with acceptance 1 ends the chain")

    def branching(self, p, q, draws):
        out = dict.fromkeys(draws, 0.0)
        alive = 1.0
        for x, value in self._residual_chain(p, q, draws):
            if x is None:
                # A rejected token has zero residual mass from then on, but the correction may still land
                # on a drafted token that was never tested; count it exactly rather than assume zero.
                tail = value[as_index(list(out))].tolist()
                for t, mass in zip(out, tail, strict=True):
                    out[t] += alive * mass
                break
            out[x] += alive * value
            alive *= 1.0 - value
        return out


class RSDSolver(SpecInferSolver):
    """Recursive rejection sampling without replacement (RSD): q drops each rejected draw."""

    name = "rsd"

    def _next_draft(self, q_cur, rejected):
        q_next = q_cur.clone()
        q_next[rejected] = 0.0
        return normalized(q_next)


def _kseq_gap(rho: float, a: float, b: float, k: int) -> float:
    """``1 - (1 - β)^k - ρβ`` with ``β = a/ρ + b``: K-SEQ's feasibility gap (<= 0 means feasible)."""
    beta = a / rho + b
    return 1.0 - (1.0 - beta) ** k - rho * beta


def _masses_at(ratio: torch.Tensor, p: torch.Tensor, q: torch.Tensor, rho: float) -> tuple[float, float]:
    """(Σ_{p/q <= ρ} p, Σ_{p/q > ρ} q): β(ρ) = a/ρ + b."""
    below = ratio <= rho
    return float(torch.where(below, p, 0.0).sum()), float(torch.where(below, 0.0, q).sum())


def _solve_in_cell(ratio, p, q, k: int, lo: float, hi: float, a: float, b: float) -> float | None:
    """The root of the gap on [lo, hi], exactly, returned on its feasible side; None if it is not in [lo, hi].

    ``(a, b)`` are the masses at ``lo`` (:func:`_masses_at`). Between consecutive ratios p/q the gap has the
    closed form of :func:`_kseq_gap` with fixed (a, b): find the segment holding the root among the sorted
    ratios inside the cell, then bisect the scalar form there.
    """
    if _kseq_gap(lo, a, b, k) <= 0.0:
        return lo if lo == 1.0 else None  # a root at or below lo > 1 means the bracket is off
    inside = (ratio > lo) & (ratio < hi)
    r_sorted, order = torch.sort(ratio[inside])
    if r_sorted.numel():
        p_cum = a + torch.cumsum(p[inside][order], 0)
        q_cum = b - torch.cumsum(q[inside][order], 0)
        # At breakpoint r_j the segment to its right has (a, b) = (p_cum[j], q_cum[j]); the gap is continuous.
        beta_at = p_cum / r_sorted + q_cum
        gap_at = 1.0 - (1.0 - beta_at) ** k - r_sorted * beta_at
        nonpos = torch.nonzero(gap_at <= 0.0)
        j = int(nonpos[0]) if nonpos.numel() else r_sorted.numel()
        if j < r_sorted.numel():
            hi = float(r_sorted[j])
        if j > 0:
            lo = float(r_sorted[j - 1])
            a, b = float(p_cum[j - 1]), float(q_cum[j - 1])
    if _kseq_gap(hi, a, b, k) > 0.0:
        return None  # the root lies above the cell
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if mid <= lo or mid >= hi:
            break
        if _kseq_gap(mid, a, b, k) <= 0.0:
            hi = mid
        else:
            lo = mid
    return hi


def spectr_rho(p: torch.Tensor, q: torch.Tensor, k: int, grid: int = 64) -> float:
    """K-SEQ's ρ*: the root of ``1 - (1 - β(ρ))^k - ρ β(ρ)`` on [1, k], returned on its feasible side.

    ``β(ρ) = Σ min(p/ρ, q)`` is piecewise ``a/ρ + b`` between the sorted ratios p/q, so the root can be found
    exactly (algorithms.md §2.6). To avoid sorting the vocabulary, one bincount per model first narrows
    [1, k] to one cell of a uniform grid. Only the ratios inside that cell are then sorted. The residual
    ``p - γ min(p/ρ, q)`` is non-negative on the returned side.
    """
    if k <= 1:
        return 1.0
    ratio = torch.div(p, q).nan_to_num_(nan=math.inf)  # q = 0: +inf (never below ρ, no q-mass)
    lo, hi = 1.0, float(k)
    if ratio.numel() > 4 * grid:
        step = (k - 1) / grid
        # Token with ratio r lands in cell j when r is in (g_{j-1}, g_j], g_j = 1 + j·step (0: r <= 1).
        cell = ratio.sub(1.0).div_(step).ceil_().clamp_(0, grid + 1).long()
        a_grid = torch.cumsum(torch.bincount(cell, weights=p, minlength=grid + 2), 0)[: grid + 1]
        b_grid = float(q.sum()) - torch.cumsum(torch.bincount(cell, weights=q, minlength=grid + 2), 0)[: grid + 1]
        points = 1.0 + step * torch.arange(grid + 1, dtype=a_grid.dtype)
        beta = a_grid / points + b_grid
        gap = 1.0 - (1.0 - beta) ** k - points * beta
        nonpos = torch.nonzero(gap <= 0.0)
        j = int(nonpos[0]) if nonpos.numel() else grid
        if j > 0:
            lo, hi = float(points[j - 1]), float(points[j])
    root = _solve_in_cell(ratio, p, q, k, lo, hi, *_masses_at(ratio, p, q, lo))
    if root is None:
        # The grid sums can misplace a ratio lying within rounding of a grid point: solve on all of [1, k].
        root = _solve_in_cell(ratio, p, q, k, 1.0, float(k), *_masses_at(ratio, p, q, 1.0))
    return float(k) if root is None else root  # ρ = k is always feasible (Bernoulli's inequality)


class SpecTrSolver(OTLPSolver):
    """SpecTr's K-SEQ: accept draw i w.p. min(1, p/(ρ* q)) in order, else sample the K-SEQ residual."""

    name = "spectr"
    single_draw = staticmethod(accept_prob)  # one draw: every rule but NSS is standard speculative sampling

    def rho(self, p, q, k: int) -> float:
        return spectr_rho(p, q, k)

    def _accepts(self, p, q, draws, rho: float) -> list[float]:
        tokens = as_index(draws)
        return [accept_prob(a / rho, b) for a, b in zip(p[tokens].tolist(), q[tokens].tolist(), strict=True)]

    def _residual(self, p, q, k: int, rho: float) -> torch.Tensor:
        """Unnormalised K-SEQ residual ``(p - γ min(p/ρ, q))_+``, needed only once every draw is rejected."""
        capped = torch.minimum(p / rho, q)
        beta = float(capped.sum())
        gamma = (1.0 - (1.0 - beta) ** k) / beta if beta > 0.0 else 0.0
        return (p - capped * gamma).clamp_min_(0.0)

    def sample(self, p, q, draws, rng):
        if not draws:
            return rng.categorical(p)
        rho = self.rho(p, q, len(draws))
        for x, a in zip(draws, self._accepts(p, q, draws, rho), strict=True):
            if rng.bernoulli(a):
                return x
        return sample_residual(rng, self._residual(p, q, len(draws), rho), p)

    def branching(self, p, q, draws):
        rho = self.rho(p, q, len(draws))
        out = dict.fromkeys(draws, 0.0)
        alive = 1.0
        for x, a in zip(draws, self._accepts(p, q, draws, rho), strict=True):
            out[x] += alive * a
            alive *= 1.0 - a
        if alive > 0.0:
            r = normalized(self._residual(p, q, len(draws), rho))[as_index(list(out))].tolist()
            for t, mass in zip(out, r, strict=True):
                out[t] += alive * mass
        return out
