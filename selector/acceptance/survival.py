"""The survival model: the chance that an already-drawn trunk token is accepted, given what the draft knows of it.

Before a trunk token x_j is drawn, the chance it is accepted is β_{j-1} = 1 − TV(p, q) at the law it will be drawn
from (the acceptance model, selector/acceptance/acceptance.py). Once it is drawn the draft knows more: q(x_j), its
rank, q(x_j) over the law's top probability. A favourite drawn from a confident law is accepted far more often than
a long-tail token drawn from the same law, and the trunk's survival P_d (the chance the d tokens drawn so far are all
accepted) moves with each draw. A rule reading P_d still halts on a stopping time of the draft's own draws: P_d reads
x_1..x_d, never x_{d+1} nor the target.

ŝ is a logistic regression on a fixed basis: the law's (:func:`law_basis`: entropy, its square root, top probability,
its log, temperature, entropy × temperature) and the drawn token's (:func:`draw_basis`: q, log q, q / top, log of
it, whether it is the favourite, log(1 + rank)), fitted by Newton's method on a dense data set's realized label
min(1, p(x)/q(x)) (data_gen/dense.py), whose mean given the draw is the verifier's acceptance of x_j as a one-token
draft. Beside it, β̂ of the next draw is the same regression on the law's basis alone, fitted on the exact β.

At trunk depth d the survival signals read (:func:`trunk_survival`): P_d = ŝ_1 ⋯ ŝ_d, the reach P_d β̂_d (the chance a
token drawn at d is accepted, given the draws so far) and the marginal rule's ratio on them
(decode/policies/halting.py ``survival_gain``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from decode.policies.fit.rule_fit import folds_by_prompt
from decode.policies.halting import survival_gain
from decode.policies.signals import TrunkArrays
from selector.acceptance.acceptance import soft_cross_entropy

LAW_FEATURES = ("entropy", "sqrt_entropy", "top", "log_top", "temperature", "entropy_x_temperature")
# the drawn token's features by group: the study removes one group at a time to see what moves the held-out loss
DRAW_GROUPS = {"q": ("q", "log_q"), "ratio": ("ratio", "log_ratio"), "rank": ("is_top", "log_rank")}
DRAW_FEATURES = tuple(name for group in DRAW_GROUPS.values() for name in group)


def _log(x: np.ndarray) -> np.ndarray:
    return np.log(np.maximum(x, 1e-30))


def law_basis(entropy: np.ndarray, top: np.ndarray, temperature: np.ndarray | float) -> np.ndarray:
    """``(..., 6)`` the law's basis (:data:`LAW_FEATURES`) from its entropy (nats), top probability and the sampling
    temperature (each ``(...)`` or broadcastable)."""
    entropy = np.maximum(np.asarray(entropy, dtype=np.float64), 0.0)
    top = np.asarray(top, dtype=np.float64)
    temperature = np.broadcast_to(np.asarray(temperature, dtype=np.float64), entropy.shape)
    return np.stack([entropy, np.sqrt(entropy), top, _log(top), temperature, entropy * temperature], axis=-1)


def draw_basis(q: np.ndarray, rank: np.ndarray, top: np.ndarray, groups: tuple[str, ...] = tuple(DRAW_GROUPS)
               ) -> np.ndarray:
    """``(..., F)`` the drawn token's basis from its probability ``q``, its ``rank`` and its law's ``top``
    probability (each ``(...)``), the features of ``groups`` (:data:`DRAW_GROUPS`) in that order."""
    q = np.asarray(q, dtype=np.float64)
    ratio = q / np.maximum(np.asarray(top, dtype=np.float64), 1e-30)
    rank = np.asarray(rank, dtype=np.float64)
    columns = {"q": q, "log_q": _log(q), "ratio": ratio, "log_ratio": _log(ratio), "is_top": (rank == 0) * 1.0,
               "log_rank": np.log1p(np.maximum(rank, 0.0))}
    return np.stack([columns[name] for group in groups for name in DRAW_GROUPS[group]], axis=-1)


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * z))  # no overflow for large |z|


@dataclass(frozen=True)
class Logistic:
    """``sigmoid(((x − mean) / std) · weight + bias)``: a logistic regression on standardised features ``(F,)``."""

    weight: np.ndarray
    bias: float
    mean: np.ndarray
    std: np.ndarray

    def predict(self, x: np.ndarray) -> np.ndarray:
        """``(...)`` the probability at features ``x`` ``(..., F)``."""
        return _sigmoid(((np.asarray(x, dtype=np.float64) - self.mean) / self.std) @ self.weight + self.bias)


def fit_logistic(x: np.ndarray, label: np.ndarray, l2: float = 1e-3, iterations: int = 50) -> Logistic:
    """The logistic regression of a soft ``label`` ``(N,)`` in [0, 1] on ``x`` ``(N, F)`` minimising the mean binary
    cross-entropy plus ``l2`` / 2 · |weight|² (the bias unpenalised), by Newton's method (the loss is convex and F
    small; the penalty keeps a separable feature finite).

    Raises:
        ValueError: no rows, mismatched shapes, or a label outside [0, 1] or not finite.
    """
    x, label = np.asarray(x, dtype=np.float64), np.asarray(label, dtype=np.float64)
    if x.ndim != 2 or label.shape != (len(x),) or not len(x):
        raise ValueError(f"fit_logistic needs x (N, F) and label (N,) with N >= 1, got {x.shape} and {label.shape}")
    if not (np.isfinite(label).all() and (label >= 0).all() and (label <= 1).all()):
        raise ValueError("fit_logistic: the label must be finite and in [0, 1]")
    mean, std = x.mean(axis=0), x.std(axis=0)
    std = np.where(std > 1e-9, std, 1.0)  # a constant column keeps weight 0
    z = np.concatenate([(x - mean) / std, np.ones((len(x), 1))], axis=1)
    penalty = np.full(z.shape[1], l2)
    penalty[-1] = 0.0
    w = np.zeros(z.shape[1])
    w[-1] = np.log(max(label.mean(), 1e-6) / max(1 - label.mean(), 1e-6))
    for _ in range(iterations):
        p = _sigmoid(z @ w)
        grad = z.T @ (p - label) / len(z) + penalty * w
        hessian = (z * (p * (1 - p))[:, None]).T @ z / len(z) + np.diag(penalty + 1e-9)
        step = np.linalg.solve(hessian, grad)
        w -= step
        if np.abs(step).max() < 1e-10:
            break
    return Logistic(w[:-1], float(w[-1]), mean, std)


# ------------------------------------------------------------------------------------------------- dense data


@dataclass(frozen=True)
class DenseDraws:
    """Every node of a dense data set with the token drawn there, ``(N,)`` each.

    Attributes:
        entropy, top, temperature: the law the token was drawn from and the sampling temperature.
        token_q, token_rank: the drawn token's probability and rank under that law (rank −1 where the set does not
            say: it stores a token's rank only as the next node's draw, and a node at depth 0 resets it).
        beta: 1 − TV(p, q) of the law; realized: min(1, p(x)/q(x)) of the drawn token.
        prompts: prompt ids; hidden: ``(N, H)`` the draft's final hidden state (None unless asked for).
    """

    entropy: np.ndarray
    top: np.ndarray
    temperature: np.ndarray
    token_q: np.ndarray
    token_rank: np.ndarray
    beta: np.ndarray
    realized: np.ndarray
    prompts: np.ndarray
    hidden: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.beta)

    def take(self, rows: np.ndarray) -> DenseDraws:
        return DenseDraws(self.entropy[rows], self.top[rows], self.temperature[rows], self.token_q[rows],
                          self.token_rank[rows], self.beta[rows], self.realized[rows], self.prompts[rows],
                          None if self.hidden is None else self.hidden[rows])

    def law(self) -> np.ndarray:
        """``(N, 6)`` :func:`law_basis` at every node."""
        return law_basis(self.entropy, self.top, self.temperature)

    def draws(self, groups: tuple[str, ...] = tuple(DRAW_GROUPS)) -> np.ndarray:
        """``(N, F)`` :func:`draw_basis` of every node's drawn token."""
        return draw_basis(self.token_q, self.token_rank, self.top, groups)


def token_ranks(keys: np.ndarray, depth: np.ndarray, draw_rank: np.ndarray) -> np.ndarray:
    """``(N,)`` the rank of the token drawn at each row, from rows in continuation order: ``keys`` ``(N,)`` one
    label per continuation, ``depth`` and ``draw_rank`` ``(N,)`` the dense columns. The token drawn at row i is row
    i + 1's draw in the same continuation, unless row i + 1 is at depth 0 (its draw is the root's, 1, 0, 1): −1
    there and at a continuation's last row."""
    ranks = np.full(len(keys), -1, dtype=np.int64)
    known = np.zeros(len(keys), dtype=bool)
    known[:-1] = (keys[1:] == keys[:-1]) & (depth[1:] != 0)
    ranks[:-1][known[:-1]] = draw_rank[1:][known[:-1]]
    return ranks


def load_dense_draws(folder: str | Path, hidden: bool = False) -> DenseDraws:
    """Every node of a dense data set of schema 2 (drawn from the draft), with its drawn token's rank
    (:func:`token_ranks`); ``hidden`` also reads the draft's hidden states.

    Raises:
        ValueError: no dense data set there, one before schema 2, or one whose continuations the target drew.
    """
    from selector.acceptance.acceptance_data import read_dense_columns, read_dense_metadata

    metadata = read_dense_metadata(folder)
    if metadata.get("schema_version", 1) < 2 or metadata.get("spec", {}).get("source", "draft") != "draft":
        raise ValueError(f"{folder}: the survival model needs a dense set of schema 2 drawn from the draft")
    names = ["prompt_id", "temperature", "continuation", "position", "depth", "entropy", "top1", "beta", "token_q",
             "realized", "draw_rank"] + (["draft_hidden"] if hidden else [])
    column = read_dense_columns(folder, names)
    prompts = np.asarray([str(p) for p in column["prompt_id"]], dtype=object)
    prompt_code = np.unique(prompts.astype(str), return_inverse=True)[1]
    order = np.lexsort((column["position"], column["continuation"], column["temperature"], prompt_code))
    continuation = np.unique(np.stack([prompt_code, np.unique(column["temperature"], return_inverse=True)[1],
                                       column["continuation"]], axis=1), axis=0, return_inverse=True)[1]
    ranks = token_ranks(continuation.reshape(-1)[order], column["depth"][order], column["draw_rank"][order])
    states = column["draft_hidden"].astype(np.float32)[order] if hidden else None
    as_float = {name: column[name][order].astype(np.float64) for name in
                ("entropy", "top1", "temperature", "token_q", "beta", "realized")}
    return DenseDraws(as_float["entropy"], as_float["top1"], as_float["temperature"], as_float["token_q"], ranks,
                      as_float["beta"], as_float["realized"], prompts[order], states)


# ---------------------------------------------------------------------------------------------------- the model


@dataclass(frozen=True)
class SurvivalModel:
    """ŝ of a drawn token (law and draw basis, fitted on the realized label) and β̂ of the next draw (law basis,
    fitted on the exact β)."""

    survival: Logistic
    next_beta: Logistic

    def token_survival(self, entropy: np.ndarray, top: np.ndarray, temperature: np.ndarray | float, q: np.ndarray,
                       rank: np.ndarray) -> np.ndarray:
        """``(...)`` ŝ of tokens drawn with probability ``q`` and ``rank`` from laws of ``entropy`` and ``top``."""
        return self.survival.predict(np.concatenate([law_basis(entropy, top, temperature), draw_basis(q, rank, top)],
                                                    axis=-1))

    def beta(self, entropy: np.ndarray, top: np.ndarray, temperature: np.ndarray | float) -> np.ndarray:
        """``(...)`` β̂ of a token about to be drawn from laws of ``entropy`` and ``top``."""
        return self.next_beta.predict(law_basis(entropy, top, temperature))


def fit_survival(draws: DenseDraws, l2: float = 1e-3) -> SurvivalModel:
    """The survival model on every node of ``draws`` whose drawn token's rank is known (β̂ on every node)."""
    known = draws.token_rank >= 0
    survival = fit_logistic(np.concatenate([draws.law(), draws.draws()], axis=1)[known], draws.realized[known], l2)
    return SurvivalModel(survival, fit_logistic(draws.law(), draws.beta, l2))


def trunk_survival(model: SurvivalModel, entropy: np.ndarray, top: np.ndarray, temperature: float,
                   draw_q: np.ndarray, draw_rank: np.ndarray) -> np.ndarray:
    """``(..., D)`` P_d = ŝ_1 ⋯ ŝ_d at trunk depths 0..D-1 (P_0 = 1) from the trunk states ``(..., D)``: the law at
    each depth (``entropy``, ``top``) and the token drawn from the law at depth d − 1 (``draw_q``, ``draw_rank`` at
    depth d; decode/policies/signals.py ``TrunkArrays``). P_d reads depths up to d only."""
    s = model.token_survival(entropy[..., :-1], top[..., :-1], temperature, draw_q[..., 1:], draw_rank[..., 1:])
    return np.concatenate([np.ones_like(s[..., :1]), np.cumprod(s, axis=-1)], axis=-1)


def survival_signals(model: SurvivalModel, arrays: TrunkArrays, temperature: float, chain_ms: np.ndarray | None = None
                     ) -> dict[str, np.ndarray]:
    """``(..., D)`` the survival signals on trunk states ``arrays`` (decode/policies/signals.py ``TrunkArrays``, with
    draws) at ``temperature``: ``survival`` P_d β̂_d (the chance a token drawn at depth d is accepted, given the
    draws so far), and with the chains' step times ``chain_ms`` ``(..., D)`` the marginal rule on it,
    ``survival_marginal``."""
    if not arrays.has_draws:
        raise ValueError("the survival signals read the trunk's draws: a collection of schema 3 is needed")
    survival = trunk_survival(model, arrays.entropy, arrays.top, temperature, arrays.draw_q, arrays.draw_rank)
    beta = model.beta(arrays.entropy, arrays.top, temperature)
    out = {"survival": survival * beta}
    if chain_ms is not None:
        out["survival_marginal"] = survival_gain(survival, beta, chain_ms)
    return out


# ------------------------------------------------------------------------------------------- held-out figures


def heldout_cross_entropy(x: np.ndarray, label: np.ndarray, prompts: np.ndarray, folds: int = 8,
                          fraction: float = 1.0, seed: int = 0, l2: float = 1e-3) -> float:
    """Cross-fitted mean cross-entropy of the logistic regression of ``label`` ``(N,)`` on ``x`` ``(N, F)``: each
    fold of prompts scored by the fit on ``fraction`` of the other folds' prompts (drawn with ``seed``)."""
    rng = np.random.default_rng(seed + 1)
    total = 0.0
    for test in folds_by_prompt(prompts, folds, seed):
        rest = np.setdiff1d(np.arange(len(label)), test)
        kept = np.array(sorted(set(prompts[rest].tolist())), dtype=object)
        kept = kept[rng.permutation(len(kept))[:max(1, round(fraction * len(kept)))]]
        train = rest[np.isin(prompts[rest], kept)]
        total += soft_cross_entropy(fit_logistic(x[train], label[train], l2).predict(x[test]), label[test]) * len(test)
    return total / len(label)
