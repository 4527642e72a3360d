"""The per-node signal registry (decode/policies/signals.py): each signal's online form, computed by the drafting loop
at a trunk node, equals its offline form over the columns the collector stores for the same trunk; an expander rule
names any registered signal; old collections without draws leave the draws' signals out."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from data_gen.collector import trunk_states
from data_gen.schema import TRUNK_DRAW_COLUMNS, TRUNK_STATE_COLUMNS
from data_gen.union import grow_union_forest
from decode.drafting.actions import Action
from decode.drafting.delayed import TrunkNode, draft_delayed_tree
from decode.drafting.sampling import SamplingConfig, distributions
from decode.models.cached_lm import CachedLM
from decode.policies.expander import HaltingPolicy
from decode.policies.files.expander_file import SIGNALS as FILE_SIGNALS
from decode.policies.files.expander_file import HaltingRule, NodeRule
from decode.policies.signals import SIGNALS, TrunkArrays, model_signals, signal_names
from tests.data_gen.test_dense import _law, _path  # a recompute's law; a node's path
from tests.factories import tiny_llama

VOCAB, PROMPT, L_MAX = 24, [3, 7, 2, 9, 4], 3
SAMPLING = SamplingConfig(1.0)


class ScriptedDraws:
    """A random source that draws the given indices in order (the union forest's trunk, replayed by the loop)."""

    def __init__(self, indices: list[int]) -> None:
        self.indices = list(indices)

    def categorical(self, weights: torch.Tensor) -> int:
        index = self.indices.pop(0)
        assert float(weights[index]) > 0
        return index


@pytest.fixture(scope="module")
def collected_and_looped():
    """The collector's trunk columns of a union forest, and the trunk nodes the drafting loop meets when it draws the
    same trunk tokens."""
    draft = CachedLM(tiny_llama(seed=2, vocab=VOCAB, hidden=16, layers=1, logit_scale=2.0))
    forest = grow_union_forest(_law(draft, PROMPT), lambda f, nodes: torch.stack(
        [_law(draft, PROMPT + _path(f, v)) for v in nodes]), 2, 2, L_MAX, torch.Generator().manual_seed(0))
    hidden = {v: torch.zeros(16) for v in range(forest.num_nodes)}
    columns = trunk_states(forest, forest.q_matrix(), hidden)
    shape = (len(forest.samples), L_MAX + 1)
    arrays = TrunkArrays(*(np.asarray(columns[c], dtype=np.float64).reshape(shape)
                           for c in (TRUNK_STATE_COLUMNS[2], TRUNK_STATE_COLUMNS[1], *TRUNK_DRAW_COLUMNS)))
    looped = []
    for sample in forest.samples:
        trunk_tokens = [forest.tokens[v] for v in sample.trunk[1:L_MAX + 1]]
        q_root = distributions(draft.prefill(PROMPT)[-1], SAMPLING)
        nodes: list[TrunkNode] = []
        draft_delayed_tree(draft, q_root, Action(1, L_MAX + 1, 0), SAMPLING, ScriptedDraws(trunk_tokens + [0]),
                           halting=lambda node, nodes=nodes: nodes.append(node) or node.depth > L_MAX)
        looped.append(nodes[:L_MAX + 1])
    return arrays, looped


@pytest.mark.parametrize("name", signal_names())
def test_each_signals_online_form_equals_its_offline_form_on_the_same_trunk(collected_and_looped, name):
    arrays, looped = collected_and_looped
    offline = SIGNALS[name].offline(arrays)
    online = np.array([[SIGNALS[name].online(node) for node in nodes] for nodes in looped])
    assert offline.shape == online.shape == (2, L_MAX + 1)
    np.testing.assert_allclose(online, offline, rtol=1e-4, atol=1e-5)  # a cached pass against a recompute
    if SIGNALS[name].reads_draws:
        assert len(np.unique(np.round(offline[:, 1:], 6))) > 1  # the draws vary: a constant would pass unseen


def test_a_node_sees_only_the_draws_made_before_it(collected_and_looped):
    _, looped = collected_and_looped
    for nodes in looped:
        assert [len(node.draws) for node in nodes] == list(range(L_MAX + 1))
        assert nodes[0].draws == () and SIGNALS["path_logq"].online(nodes[0]) == 0.0


def test_collections_without_draws_leave_the_draws_signals_out():
    arrays = TrunkArrays(np.ones((1, 1, 3)), np.zeros((1, 1, 3)))
    assert signal_names(arrays) == ["top", "entropy"]
    assert set(signal_names()) | set(model_signals()) == set(SIGNALS) and {"draw_q", "path_logq"} <= set(SIGNALS)


def test_the_model_signals_are_registered_and_run_the_files_graph():
    """learned, acceptance and marginal have no form of their own: the expander file's graph computes them, and the
    marginal rule reads the acceptance model's β̂ with the machine's chain times."""
    assert model_signals() == ["learned", "acceptance", "marginal"] and not set(model_signals()) & set(signal_names())
    assert all(SIGNALS[name].reads_head and name in FILE_SIGNALS for name in model_signals())
    assert [name for name in SIGNALS if SIGNALS[name].reads_chain_ms] == ["marginal"]
    assert SIGNALS["marginal"].marginal_of == "acceptance" and not SIGNALS["top"].reads_head


@pytest.mark.parametrize("name", ["draw_q", "path_logq", "draw_rank"])
def test_an_expander_rule_halts_on_any_registered_signal(collected_and_looped, name):
    assert name in FILE_SIGNALS
    _, looped = collected_and_looped
    node = looped[0][2]
    value = SIGNALS[name].online(node)
    rule = NodeRule(1.0, 1.0, name, "1,2,0", HaltingRule(value + 1e-3, 0, 3, 1, 0))
    policy = HaltingPolicy(rule)
    assert policy.halts(node) and not policy.needs_draft_hidden
    lower = HaltingPolicy(NodeRule(1.0, 1.0, name, "1,2,0", HaltingRule(value - 1e-3, 0, 3, 1, 0)))
    assert not lower.halts(node)
