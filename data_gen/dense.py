"""Dense per-node acceptance labels: every position of a sampled continuation is a labelled node.

The tree collection (:mod:`data_gen.collector`) is the dear way to label a node: a root every ``stride`` tokens, a
forest of union trees, a target pass over hundreds of nodes. A per-node policy needs something simpler at each node
it may grow: how likely a draft drawn there is accepted. One draft pass per token and one target pass over a whole
continuation give both laws at every position of it, so each position becomes a node (SpecDec++ trains its
acceptance head this way).

For a prompt, both models prefill it once; then ``continuations`` continuations of ``length`` tokens are sampled
(from the draft, or from the target as a control) side by side, as the runs of one speculative tree after the prompt:
one C-wide pass per token, then one target pass over every run, and both caches drop the tree. At position j (the
state after the prompt and the continuation's first j tokens) a row holds:

* the features a per-node policy may read there: the draft's final hidden state, its entropy, top-1 and top-2
  probabilities at j, the node's depth (``j mod depth_cycle``: the position taken as a trunk depth from a root every
  ``depth_cycle`` tokens), the context length, the prompt's category;
* the labels: β = 1 − TV(p_j, q_j), and for every verifier and K = 1..``k_max`` its exact acceptance probability of K
  i.i.d. one-token drafts at j: the verifier's own exact E[τ + 1] − 1 on the depth-1 tree of the K draws (the
  verifier's randomness summed out exactly, as the tree collection's labels are), the K draws being the first K of
  ``k_max`` drawn from q_j with the row's seed. NaN where a verifier does not take such a tree.

* the realized labels of the token the continuation drew there, x_j (schema 2): ``token_q`` = q_j(x_j) and
  ``token_p`` = p_j(x_j) under the row's sampling (temperature, top-p), and ``realized`` = min(1, p_j(x_j)/q_j(x_j)),
  the chance the chain's verifier accepts x_j drafted from q_j, given x_j. Its mean over the draw is β, so it is a
  noisier label of the same quantity for a model that does not read x_j; its running product from a root is the
  trunk's realized survival. NaN for a continuation drawn from the target (``source="target"``): no draft drew x_j;
* the draw signals the signal registry reads at the node (decode/policies/signals.py; schema 2): ``draw_q``,
  ``draw_rank``, ``draw_top`` of the trunk token drawn before it (x_{j-1} under q_{j-1}, as
  decode/drafting/delayed.py ``draw_of`` gives it in the loop), and 1, 0, 1 at depth 0, where the loop's trunk has
  drawn nothing yet.

**Each verifier's realized acceptance of x_j**, as a one-token draft (the verifier's exact acceptance given the draw,
:func:`node_acceptance` on the chain ``[x_j]``), is one of two columns (:func:`realized_column`), never a copy:

* ``realized`` for every verifier that verifies one drafted token by rejection sampling, min(1, p/q): the token-level
  ones (naive, SpecInfer, SpecTr, RSD: on one draft each is the optimal coupling of q and p), and block verification,
  Traversal and GBV, which on a block of one token are token verification;
* ``token_p`` for NSS, which draws its own y ~ p and accepts when y = x_j: p(x_j).

A verifier registered later without a known reduction gets its own column, ``realized_<name>``. On chains of two or
more tokens block verification, Traversal and GBV accept a token with a chance that depends on the tokens drafted
after it, so no per-token realized label of theirs exists; ``realized`` is the token-level verifiers' per-token
acceptance along the chain.

The same draws on the same node give the tree collection's label of action (K, 0, 1) minus one
(``tests/data_gen/test_dense.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from data_gen.union import sample_categorical
from decode.drafting.sampling import SamplingConfig, distributions, law_entropy
from decode.drafting.tree import delayed_tree
from decode.models.cached_lm import CachedLM
from decode.verifiers import LabelRule, Verifier

SOURCES = ("draft", "target")


@dataclass(frozen=True)
class DenseSpec:
    """How a prompt's nodes are drawn.

    Attributes:
        continuations: continuations per prompt (each sharing the prompt's prefill).
        length: tokens per continuation (nodes per continuation).
        k_max: the largest K of the i.i.d. one-token drafts labelled at each node.
        source: which model samples the continuations: ``draft`` (the nodes a policy meets), or ``target`` (a
            control: the states the target's own text visits).
        depth_cycle: a node's depth feature is its position modulo this (roots every ``depth_cycle`` tokens).
    """

    continuations: int = 4
    length: int = 48
    k_max: int = 3
    source: str = "draft"
    depth_cycle: int = 8

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"source must be one of {', '.join(SOURCES)}, got {self.source!r}")
        for name in ("continuations", "length", "k_max", "depth_cycle"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")


def acceptance_column(verifier: str, k: int) -> str:
    """The column of a verifier's exact acceptance of K one-token drafts."""
    return f"accept_{verifier}_k{k}"


def node_acceptance(verifier: Verifier, draws: Sequence[int], p: torch.Tensor, q: torch.Tensor) -> float:
    """P(the verifier accepts one of ``draws``, K i.i.d. one-token drafts from ``q``) given those draws, exactly:
    its E[τ + 1] on the depth-1 tree minus one. NaN where it does not take the tree.

    Args:
        draws: the K drafted tokens.
        p, q: ``(V,)`` the target's and the draft's laws at the node.
    """
    tree = delayed_tree([], [[t] for t in draws]) if len(draws) > 1 else delayed_tree(list(draws), [[]])
    if not verifier.supports(tree):
        return float("nan")
    rows = tree.num_nodes
    p_rows, q_rows = torch.zeros(rows, p.numel(), dtype=p.dtype), torch.zeros(rows, q.numel(), dtype=q.dtype)
    p_rows[0], q_rows[0] = p, q
    p_rows[1:], q_rows[1:] = p, q  # leaves: rows no expectation reads (the bonus token's law), kept valid
    return verifier.expected_block_efficiency(tree, p_rows, q_rows) - 1.0


# Verifiers whose acceptance of one drafted token x, given x, is min(1, p(x)/q(x)) (see the module docstring), and
# those whose is p(x); tests/data_gen/test_dense.py checks both sets against node_acceptance for every verifier.
ONE_DRAFT_MIN_RATIO = frozenset({"naive", "specinfer", "spectr", "rsd", "block", "traversal", "gbv"})
ONE_DRAFT_TARGET_PROB = frozenset({"nss"})
REALIZED_COLUMNS = ("token_q", "token_p", "realized")
DRAW_COLUMNS = ("draw_q", "draw_rank", "draw_top")


def realized_column(verifier: str) -> str:
    """The column holding ``verifier``'s realized acceptance of the drawn token as a one-token draft: ``realized``
    (min(1, p/q)), ``token_p`` (p, NSS's), or ``realized_<name>`` for a verifier with neither reduction."""
    if verifier in ONE_DRAFT_MIN_RATIO:
        return "realized"
    if verifier in ONE_DRAFT_TARGET_PROB:
        return "token_p"
    return f"realized_{verifier}"


def own_realized_columns(verifiers: Sequence[Verifier]) -> list[str]:
    """The per-verifier realized columns a data set of ``verifiers`` adds to :data:`REALIZED_COLUMNS`."""
    return [c for c in dict.fromkeys(realized_column(v.name) for v in verifiers) if c not in REALIZED_COLUMNS]


def realized_labels(p: torch.Tensor, q: torch.Tensor, token: int, verifiers: Sequence[Verifier],
                    from_draft: bool = True) -> dict[str, float]:
    """The realized labels of ``token`` drawn at a node (see the module docstring).

    Args:
        p, q: ``(V,)`` the target's and the draft's laws at the node, under the row's sampling.
        token: the token drawn there.
        from_draft: whether ``token`` was drawn from ``q``; otherwise the acceptance labels are NaN (no draft drew
            it), and only ``token_q`` and ``token_p`` are facts.
    """
    q_x, p_x = float(q[token]), float(p[token])
    labels = {"token_q": q_x, "token_p": p_x,
              "realized": min(1.0, p_x / q_x) if from_draft else float("nan")}
    for verifier in verifiers:
        column = realized_column(verifier.name)
        if column not in labels:
            labels[column] = node_acceptance(verifier, [token], p, q) if from_draft else float("nan")
    return labels


def draw_signals(q_before: torch.Tensor | None, token_before: int | None) -> dict[str, float | int]:
    """``draw_q``, ``draw_rank``, ``draw_top`` at a node: those of ``token_before`` under ``q_before`` ``(V,)`` (the
    trunk's last draw and the law it was drawn from), or 1, 0, 1 at a root (both None), as the loop's
    :class:`~decode.drafting.delayed.TrunkNode` shows them."""
    from decode.drafting.delayed import draw_of

    if q_before is None or token_before is None:
        return {"draw_q": 1.0, "draw_rank": 0, "draw_top": 1.0}
    draw = draw_of(q_before, token_before)
    return {"draw_q": draw.q, "draw_rank": draw.rank, "draw_top": draw.top}


def check_verifiers(verifiers: Sequence[Verifier]) -> None:
    """ValueError for a verifier that drafts other trees than i.i.d. draws (sampling without replacement): the
    draws here would not be its drafts, as the tree collection refuses it too."""
    for verifier in verifiers:
        if verifier.label_rule == LabelRule.NONE:
            raise ValueError(f"verifier '{verifier.name}' drafts {verifier.draft_regime.value} trees, not i.i.d. "
                             "draws: dense labels cannot label it")


def node_labels(p: torch.Tensor, q: torch.Tensor, draws: Sequence[int], verifiers: Sequence[Verifier],
                k_max: int) -> dict[str, float]:
    """β = 1 − TV(p, q) and every verifier's acceptance of K = 1..k_max of ``draws`` (see the module docstring)."""
    check_verifiers(verifiers)
    labels = {"beta": float(torch.minimum(p, q).double().sum())}
    for verifier in verifiers:
        for k in range(1, k_max + 1):
            labels[acceptance_column(verifier.name, k)] = node_acceptance(verifier, draws[:k], p, q)
    return labels


def draft_signals(q: torch.Tensor) -> dict[str, float]:
    """The draft's entropy (nats; the per-node signal the expander reads in the loop, ``law_entropy``), top-1 and
    top-2 probabilities of ``q`` ``(V,)``."""
    top = q.topk(2).values
    return {"entropy": law_entropy(q), "top1": float(top[0]), "top2": float(top[1])}


def prompt_nodes(target: CachedLM, draft: CachedLM, prompt_ids: Sequence[int], sampling: SamplingConfig,
                 spec: DenseSpec, verifiers: Sequence[Verifier], seed: int) -> list[dict]:
    """Every labelled node of ``spec.continuations`` continuations of one prompt (rows without prompt metadata).

    The continuations grow side by side as one tree after the prompt: each step is one pass of C sibling tokens
    through the sampling model (a C-wide pass costs little more than a one-token pass on flat kernels), and the
    target then runs all C runs in one tree pass. Both caches hold nothing after the call.

    Raises:
        ValueError: an empty prompt, or one that leaves no room for a continuation in either model's context.
    """
    ids = list(prompt_ids)
    limit = min(target.context_limit, draft.context_limit)
    if not ids or len(ids) + spec.length + 1 > limit:
        raise ValueError(f"a prompt of {len(ids)} tokens leaves no room for {spec.length} more in the "
                         f"{limit}-token context")
    p_first = distributions(target.prefill(ids, last=1)[-1], sampling)
    q_logits, q_hidden = draft.prefill(ids, output_hidden=True, last=1)
    generator = torch.Generator().manual_seed(seed)
    runs = _continue(target, draft, p_first, distributions(q_logits[-1], sampling), q_hidden[-1], sampling, spec,
                     generator)
    rows = []
    for c, (tokens, qs, hidden, ps) in enumerate(runs):
        for j, (p, q, h) in enumerate(zip(ps, qs, hidden, strict=True)):
            draws = sample_categorical(q.unsqueeze(0).expand(spec.k_max, -1), generator)
            depth = j % spec.depth_cycle
            before = (qs[j - 1], tokens[j - 1]) if depth > 0 else (None, None)  # a root's trunk has drawn nothing
            rows.append({"continuation": c, "position": j, "depth": depth,
                         "context_length": len(ids) + j, "token": tokens[j], "draft_hidden": h.float().tolist(),
                         **draft_signals(q), **node_labels(p, q, draws, verifiers, spec.k_max),
                         **realized_labels(p, q, tokens[j], verifiers, spec.source == "draft"),
                         **draw_signals(*before)})
    target.reset()
    draft.reset()
    return rows


def _continue(target: CachedLM, draft: CachedLM, p_first, q_first, h_first, sampling: SamplingConfig,
              spec: DenseSpec, generator: torch.Generator) -> list[tuple[list, list, list, list]]:
    """The C continuations after the prompt: per continuation its tokens and, at each position, q, the draft's hidden
    state and p.

    From the draft: each step draws every run's next token from its q and runs the C tokens through the draft as
    siblings (each under its own run), then one target tree pass covers the C runs. From the target (the control):
    each step's tokens are drawn from p and run through both models the same way."""
    c_count, tip = spec.continuations, draft.length - 1
    tokens = [[] for _ in range(c_count)]
    qs, hidden, ps = ([[x] for _ in range(c_count)] for x in (q_first, h_first, p_first))
    draft_slots, target_slots = [tip] * c_count, [target.length - 1] * c_count
    for j in range(spec.length):
        laws = torch.stack([(qs if spec.source == "draft" else ps)[c][-1] for c in range(c_count)])
        drawn = sample_categorical(laws, generator)
        for c, token in enumerate(drawn):
            tokens[c].append(token)
        if j == spec.length - 1:
            break
        base = draft.length
        logits, states = draft.extend_tree(drawn, draft_slots, output_hidden=True)
        draft_slots = [base + c for c in range(c_count)]
        for c, (row, state) in enumerate(zip(distributions(logits, sampling), states, strict=True)):
            qs[c].append(row)
            hidden[c].append(state)
        if spec.source == "target":
            base = target.length
            rows = distributions(target.extend_tree(drawn, target_slots), sampling)
            target_slots = [base + c for c in range(c_count)]
            for c in range(c_count):
                ps[c].append(rows[c])
    if spec.source == "draft" and spec.length > 1:
        run = spec.length - 1  # each run's last token needs no law
        block = [tokens[c][j] for c in range(c_count) for j in range(run)]
        parents = [target_slots[c] if j == 0 else -(c * run + j) for c in range(c_count) for j in range(run)]
        rows = distributions(target.extend_tree(block, parents), sampling)
        for c in range(c_count):
            ps[c] += list(rows[c * run:(c + 1) * run])
    return [(tokens[c], qs[c], hidden[c], ps[c]) for c in range(c_count)]
