"""Per-node signals, each defined once: its online form (one trunk node in the loop, torch) beside its offline form
(every node of every episode of a collection, arrays), so a rule fitted offline reads in the loop what it was
fitted on.

A signal is what a halting rule (decode/policies/halting.py) thresholds at trunk depth d, higher meaning the draft
is surer. It may read the draft's law at the node and the trunk tokens drawn before it (decode/drafting/delayed.py
:class:`~decode.drafting.delayed.TrunkNode`), never the token the node is about to draw nor the target's outputs:
then the halting depth is a stopping time of the draft's own draws and every verifier of delayed trees stays exact
(tests/decode/exact/test_expander_loop.py; drawing a token and keeping it only where its own q is high is not, and
tests/decode/exact/test_stopping.py catches it).

The draws' signals read the last drawn trunk token x_d (drawn from the law at depth d − 1) and the whole path: its
probability q(x_d), log q(x_d), its rank, q(x_d) over that law's top probability, and the running log-product
Σ_{j ≤ d} log q(x_j) (EAGLE-2's and C2T's path confidence). At the root nothing has been drawn: q = 1, rank 0.

The model signals read the expander file's graph instead of the draft's state alone: ``learned`` and ``acceptance``
(β̂, the head's prediction of the node's acceptance: the file's ridge head, or an acceptance model trained on dense
labels) and ``marginal``, the marginal rule (decode/policies/halting.py ``marginal_gain``) on the acceptance model's β̂
and the step times of chains on the running machine. They have no offline form here: their values come from the
model that fitted them (selector/expander/).

Adding a signal is one entry of :data:`SIGNALS` (and, where it reads something no collection stores yet, a column of
data_gen/schema.py); the expander file, the offline fit, the decoder and the commands' choices iterate over this
registry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, overload

import numpy as np

if TYPE_CHECKING:  # the registry is light: listing signals must not import torch
    from decode.drafting.delayed import Draw, TrunkNode

__all__ = ["SIGNALS", "NodeSignal", "TrunkArrays", "model_signals", "signal_names"]


@dataclass(frozen=True)
class TrunkArrays:
    """A collection's trunk states, per episode and depth: each array ``(..., D)`` (usually ``(N, s, D)``).

    Attributes:
        top, entropy: the draft's top probability and entropy (nats) of the law at each depth.
        draw_q, draw_rank, draw_top: at depth d, the trunk token drawn from the law at depth d − 1: its probability,
            its rank and that law's top probability (depth 0: 1, 0, 1). None in collections made before they were
            stored (data_gen/schema.py version 2).
    """

    top: np.ndarray
    entropy: np.ndarray
    draw_q: np.ndarray | None = None
    draw_rank: np.ndarray | None = None
    draw_top: np.ndarray | None = None

    @property
    def has_draws(self) -> bool:
        return self.draw_q is not None


@dataclass(frozen=True)
class NodeSignal:
    """One per-node signal.

    Attributes:
        name: how files, configs and commands name it.
        summary: one line for help texts and tables.
        online: ``TrunkNode -> float`` at one node in the loop.
        offline: ``TrunkArrays -> (..., D)`` at every node of every episode.
        reads_draws: it reads the trunk's earlier draws (collections store them from schema 3 on).
        marginal_of: for the marginal rule, the β̂ signal it is computed from with a machine's chain times.

    A model signal has neither form (None): the expander file's graph computes it in the loop (:attr:`reads_head`).
    """

    name: str
    summary: str
    online: Callable[[TrunkNode], float] | None = None
    offline: Callable[[TrunkArrays], np.ndarray] | None = None
    reads_draws: bool = False
    marginal_of: str | None = None

    @property
    def reads_head(self) -> bool:
        """It runs the expander file's graph (β̂ at the node), and with it the draft's hidden states."""
        return self.online is None

    @property
    def reads_chain_ms(self) -> bool:
        """It reads the step times of the chains (1, d, 0): the marginal rule."""
        return self.marginal_of is not None

    def available(self, arrays: TrunkArrays) -> bool:
        """Whether ``arrays`` hold what the offline form reads (a model signal has none)."""
        return self.offline is not None and (arrays.has_draws or not self.reads_draws)


def _law_entropy(node: TrunkNode) -> float:
    from decode.drafting.sampling import law_entropy

    return law_entropy(node.q)


def _last_draw(node: TrunkNode) -> Draw:
    """The last trunk draw before ``node`` (the root's: a certain token)."""
    from decode.drafting.delayed import Draw

    return node.draws[-1] if node.draws else Draw(1.0, 0, 1.0)


@overload
def _log(x: float) -> float: ...


@overload
def _log(x: np.ndarray) -> np.ndarray: ...


def _log(x: np.ndarray | float) -> np.ndarray | float:
    return np.log(np.maximum(x, 1e-30))


def _stored(draws: np.ndarray | None) -> np.ndarray:
    """A draws array of a collection that stores them (:meth:`NodeSignal.available` asked first)."""
    if draws is None:
        raise ValueError("this collection stores no trunk draws (data_gen/schema.py version 3 on)")
    return draws


def _path_logq_offline(arrays: TrunkArrays) -> np.ndarray:
    return np.cumsum(_log(_stored(arrays.draw_q)), axis=-1)


SIGNALS: dict[str, NodeSignal] = {
    signal.name: signal
    for signal in (
        NodeSignal("top", "the draft's top probability at the node",
                   lambda node: float(node.q.max()), lambda a: a.top),
        NodeSignal("entropy", "minus the draft's entropy at the node (nats)",
                   lambda node: -_law_entropy(node), lambda a: -a.entropy),
        NodeSignal("draw_q", "q of the last drawn trunk token, under the law it was drawn from",
                   lambda node: _last_draw(node).q, lambda a: _stored(a.draw_q), reads_draws=True),
        NodeSignal("draw_logq", "log q of the last drawn trunk token",
                   lambda node: float(_log(_last_draw(node).q)), lambda a: _log(_stored(a.draw_q)), reads_draws=True),
        NodeSignal("draw_rank", "minus the last drawn trunk token's rank under its law (0: the favourite)",
                   lambda node: -float(_last_draw(node).rank), lambda a: -_stored(a.draw_rank).astype(np.float64),
                   reads_draws=True),
        NodeSignal("draw_ratio", "q of the last drawn trunk token over its law's top probability",
                   lambda node: _last_draw(node).q / _last_draw(node).top,
                   lambda a: _stored(a.draw_q) / _stored(a.draw_top), reads_draws=True),
        NodeSignal("path_logq", "the running log-product of q over the trunk's draws (the path's confidence)",
                   lambda node: float(sum(_log(d.q) for d in node.draws)), _path_logq_offline, reads_draws=True),
        NodeSignal("learned", "β̂ of the expander file's ridge head (the node's features and the root's scalars)"),
        NodeSignal("acceptance", "β̂ of an acceptance model trained on dense labels (the node's own features)"),
        NodeSignal("marginal", "the marginal rule on the acceptance model's β̂ and the machine's chain times",
                   marginal_of="acceptance"),
    )
}


def signal_names(arrays: TrunkArrays | None = None) -> list[str]:
    """Every signal computed from the draft's own state (not a model's), or those ``arrays`` can compute offline."""
    return [name for name, signal in SIGNALS.items()
            if signal.offline is not None and (arrays is None or signal.available(arrays))]


def model_signals() -> list[str]:
    """The signals that run the expander file's graph (β̂ or a rule on it), in registry order."""
    return [name for name, signal in SIGNALS.items() if signal.reads_head]
