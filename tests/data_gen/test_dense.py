"""Dense per-node labels (data_gen/dense.py) against the tree collection's exact labels on the same nodes, and the
drawn token's realized labels and draw signals against the models' own laws."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from data_gen.dense import (
    ONE_DRAFT_MIN_RATIO,
    ONE_DRAFT_TARGET_PROB,
    DenseSpec,
    acceptance_column,
    node_acceptance,
    node_labels,
    prompt_nodes,
    realized_column,
    realized_labels,
)
from data_gen.labels import label_forest
from data_gen.union import grow_union_forest
from decode.drafting.actions import Action
from decode.drafting.sampling import SamplingConfig, distributions
from decode.models.cached_lm import CachedLM
from decode.verifiers import LabelRule, get_verifier, verifier_names
from tests.factories import tiny_llama

VOCAB = 16
SAMPLING = SamplingConfig(1.0)
PROMPT = [3, 7, 2, 9, 4]


def _pair() -> tuple[CachedLM, CachedLM]:
    target = CachedLM(tiny_llama(seed=1, vocab=VOCAB, hidden=32, layers=2, logit_scale=2.0))
    draft = CachedLM(tiny_llama(seed=2, vocab=VOCAB, hidden=16, layers=1, logit_scale=2.0))
    return target, draft


def _law(lm: CachedLM, seq: list[int], sampling: SamplingConfig = SAMPLING) -> torch.Tensor:
    with torch.inference_mode():
        return distributions(lm.model(torch.tensor([seq])).logits[0, -1].float(), sampling)


def test_dense_labels_equal_the_tree_collections_on_the_same_nodes_and_draws() -> None:
    """A union forest at the prompt's end, labelled by the tree collection (action (K, 0, 1): K one-token drafts at
    the root), and the dense label of the same node with the same K draws."""
    target, draft = _pair()
    verifiers = [v for v in map(get_verifier, verifier_names()) if v.label_rule != LabelRule.NONE]
    k_max = 3
    forest = grow_union_forest(_law(draft, PROMPT), lambda f, nodes: torch.stack(
        [_law(draft, PROMPT + _path(f, v)) for v in nodes]), 2, k_max, 1, torch.Generator().manual_seed(0))
    p = torch.stack([_law(target, PROMPT + _path(forest, v)) for v in range(forest.num_nodes)])
    q = forest.q_matrix()
    actions = [Action(k, 0, 1) for k in range(1, k_max + 1)]
    labels = label_forest(forest, p, q, verifiers, actions)
    checked = 0
    for s, sample in enumerate(forest.samples):
        draws = [forest.tokens[branch[0]] for branch in sample.branches[0]]
        dense = node_labels(p[0], q[0], draws, verifiers, k_max)
        assert dense["beta"] == pytest.approx(float(labels.trunk_beta[s, 0]), abs=1e-6)
        for verifier in verifiers:
            for k in range(1, k_max + 1):
                want = labels.be_trees[verifier.name][s, k - 1] - 1.0
                got = dense[acceptance_column(verifier.name, k)]
                if math.isnan(want):
                    assert math.isnan(got), (verifier.name, k)
                else:
                    # two float32 routes to one number: they differ by rounding (6e-9 on an AMD EPYC without
                    # AVX-512), a wrong label by a share of a token
                    assert got == pytest.approx(want, abs=1e-6), (verifier.name, k)
                    checked += 1
    assert checked >= 2 * len(verifiers)  # every verifier takes K = 1 at least


def _path(forest, node: int) -> list[int]:
    path = []
    while node > 0:
        path.append(forest.tokens[node])
        node = forest.parents[node]
    return path[::-1]


def test_one_draft_is_accepted_with_probability_one_minus_tv() -> None:
    g = torch.Generator().manual_seed(3)
    p, q = torch.rand(VOCAB, generator=g), torch.rand(VOCAB, generator=g)
    p, q = p / p.sum(), q / q.sum()
    beta = float(torch.minimum(p, q).sum())
    for name in verifier_names():  # E over the draw of min(1, p/q) is 1 - TV for every verifier on one draft, but
        # naive speculative sampling (nss), which accepts when its own draw from p lands on the draft: Σ p·q
        want = float((p * q).sum()) if name == "nss" else beta
        got = sum(float(q[t]) * node_acceptance(get_verifier(name), [t], p, q) for t in range(VOCAB))
        assert got == pytest.approx(want, abs=1e-6), name


@pytest.mark.parametrize("source", ["draft", "target"])
def test_every_position_of_every_continuation_is_a_node_with_its_laws(source: str) -> None:
    target, draft = _pair()
    spec = DenseSpec(continuations=2, length=6, k_max=2, source=source, depth_cycle=4)
    verifiers = [get_verifier("specinfer"), get_verifier("traversal")]
    rows = prompt_nodes(target, draft, PROMPT, SAMPLING, spec, verifiers, seed=5)
    assert len(rows) == 2 * 6 and target.length == draft.length == 0
    assert [r["depth"] for r in rows[:6]] == [0, 1, 2, 3, 0, 1]
    for c in range(2):
        run = [r for r in rows if r["continuation"] == c]
        tokens = [r["token"] for r in run]
        for j, row in enumerate(run):  # the laws at j are the models' own after the prompt and tokens[:j]
            seq = PROMPT + tokens[:j]
            p, q = _law(target, seq), _law(draft, seq)
            assert row["beta"] == pytest.approx(float(torch.minimum(p, q).sum()), abs=1e-5)
            assert row["top1"] == pytest.approx(float(q.max()), abs=1e-5)
            assert row["context_length"] == len(seq)
            assert 0.0 <= row[acceptance_column("specinfer", 1)] <= 1.0
    assert len({tuple(r["token"] for r in rows if r["continuation"] == c) for c in range(2)}) == 2
    again = prompt_nodes(target, draft, PROMPT, SAMPLING, spec, verifiers, seed=5)
    assert [r["token"] for r in again] == [r["token"] for r in rows]  # seeded
    assert np.isfinite([r["entropy"] for r in rows]).all()


def test_a_verifier_drawing_without_replacement_is_refused() -> None:
    with pytest.raises(ValueError, match="not i.i.d. draws"):
        node_labels(torch.ones(4) / 4, torch.ones(4) / 4, [0, 1], [get_verifier("rsd")], 2)


def test_a_prompt_without_room_is_refused() -> None:
    target, draft = _pair()
    with pytest.raises(ValueError, match="leaves no room"):
        prompt_nodes(target, draft, list(range(60)), SAMPLING, DenseSpec(length=10), [], seed=0)


def _metadata(spec: DenseSpec, **changes) -> dict:
    from data_gen.dense_collection import dense_metadata

    metadata = dense_metadata("fingerprint", None, spec, [1.0], 1.0, [get_verifier("specinfer")], "prompts.jsonl", 2,
                              seed=0, command="ddte dense-labels", prompts_per_shard=1)
    return {**metadata, **changes}


@pytest.mark.parametrize(("temperatures", "top_p"), [([math.nan], 1.0), ([math.inf], 1.0), ([-1.0], 1.0),
                                                     ([1.0, 1.0], 1.0), ([1.0], math.nan), ([1.0], 0.0)])
def test_a_sampling_setting_that_is_none_is_refused_before_any_write(tmp_path, temperatures, top_p) -> None:
    from data_gen.dense_collection import collect_dense, dense_metadata

    spec = DenseSpec(continuations=1, length=3, k_max=1)
    with pytest.raises(ValueError, match="temperature|top_p"):
        dense_metadata("f", None, spec, temperatures, top_p, [], "p", 1, 0, "c")
    target, draft = _pair()
    out = tmp_path / "dense"
    with pytest.raises(ValueError, match="temperature|top_p"):  # metadata made by hand: collect_dense checks it too
        collect_dense(target, draft, [PROMPT], ["none"], out, _metadata(spec, temperatures=temperatures, top_p=top_p),
                      spec, [get_verifier("specinfer")], 1)
    assert not out.exists()


def test_shards_of_one_set_start_together_and_another_set_is_refused_by_its_keys(tmp_path) -> None:
    """Two shards started at once on a new folder (a SLURM array): both label their chunk, the first dense.json wins
    and the other matches it though its kernels line (times measured) and command differ; another seed is refused
    by name, as is a folder of the user's own files, and a shard without a chunk writes nothing."""
    import threading

    from data_gen.dense_collection import collect_dense

    spec = DenseSpec(continuations=1, length=3, k_max=1)
    verifiers, out = [get_verifier("specinfer")], tmp_path / "dense"
    barrier, failures = threading.Barrier(2), []

    def shard(i: int) -> None:
        target, draft = _pair()
        metadata = _metadata(spec, kernels=f"kernels: target default (measured {i} ms), draft default",
                             command=f"ddte dense-labels --shard {i}/2")
        barrier.wait()
        try:
            collect_dense(target, draft, [PROMPT, PROMPT[1:]], ["none"] * 2, out, metadata, spec, verifiers, 1, (i, 2))
        except Exception as err:  # noqa: BLE001 - reported below, with the shard
            failures.append((i, err))

    threads = [threading.Thread(target=shard, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "dense-00000.parquet", "dense-00001.parquet",
                                                     "dense.json"]
    target, draft = _pair()
    with pytest.raises(ValueError, match=r"differs in: seed \(0 there, 7 here\)\)"):
        collect_dense(target, draft, [PROMPT, PROMPT[1:]], ["none"] * 2, out, _metadata(spec, seed=7), spec,
                      verifiers, 1, (0, 2), resume=True)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not empty and holds no dense data set"):
        collect_dense(target, draft, [PROMPT], ["none"], tmp_path / "mine", _metadata(spec), spec, verifiers, 1)
    summary = collect_dense(target, draft, [PROMPT], ["none"], tmp_path / "spare", _metadata(spec), spec, verifiers, 1,
                            (1, 2))
    assert summary.nodes == summary.shards_written == 0 and not (tmp_path / "spare").exists()


CONFIGURED = SamplingConfig(0.7, 0.9)  # a temperature and a top-p, so that a label under plain q would differ


def _realized_mismatches(rows: list[dict], draft_law) -> int:
    """Rows whose ``realized`` is not min(1, p(x)/q(x)) recomputed from the models' full forward passes, with q from
    ``draft_law(seq)`` and p the target's under the configured sampling."""
    target, _ = _pair()
    bad = 0
    for row in rows:
        seq = PROMPT + [r["token"] for r in rows if r["continuation"] == row["continuation"]][:row["position"]]
        p, q = _law(target, seq, CONFIGURED), draft_law(seq)
        x = row["token"]
        want = min(1.0, float(p[x]) / float(q[x])) if float(q[x]) > 0 else math.inf
        bad += not (row["realized"] == pytest.approx(want, abs=1e-5) and row["token_q"] == pytest.approx(
            float(q[x]), abs=1e-6) and row["token_p"] == pytest.approx(float(p[x]), abs=1e-6))
    return bad


def test_the_realized_label_is_min_one_p_over_q_of_the_drawn_token_under_the_configured_sampling() -> None:
    """Each row's drawn token x: ``realized`` = min(1, p(x)/q(x)) with p and q recomputed independently (one full
    forward pass per prefix, no cache) at T = 0.7, top-p 0.9. The negative control recomputes q at T = 1 without
    top-p (the wrong q) and must not match."""
    target, draft = _pair()
    spec = DenseSpec(continuations=2, length=6, k_max=1, depth_cycle=4)
    rows = prompt_nodes(target, draft, PROMPT, CONFIGURED, spec, [get_verifier("specinfer"), get_verifier("nss")],
                        seed=11)
    _, fresh_draft = _pair()
    assert _realized_mismatches(rows, lambda seq: _law(fresh_draft, seq, CONFIGURED)) == 0
    assert any(r["realized"] < 1.0 for r in rows)  # some token is rejectable, so the check has teeth
    assert _realized_mismatches(rows, lambda seq: _law(fresh_draft, seq, SAMPLING)) > len(rows) // 2  # wrong q
    assert all(r["token_q"] > 0 for r in rows)  # drawn from q under top-p: inside its nucleus


def test_the_draw_signals_are_the_trunks_last_draw_as_the_loop_shows_it() -> None:
    """At depth d > 0: the token drawn at the position before, under the draft's law there (its q, its rank, that
    law's top probability), recomputed from the model; at depth 0: 1, 0, 1 (the loop's root has drawn nothing)."""
    target, draft = _pair()
    spec = DenseSpec(continuations=2, length=7, k_max=1, depth_cycle=3)
    rows = prompt_nodes(target, draft, PROMPT, CONFIGURED, spec, [get_verifier("specinfer")], seed=2)
    _, fresh_draft = _pair()
    for row in rows:
        if row["depth"] == 0:
            assert (row["draw_q"], row["draw_rank"], row["draw_top"]) == (1.0, 0, 1.0)
            continue
        run = [r for r in rows if r["continuation"] == row["continuation"]]
        before = run[row["position"] - 1]
        q = _law(fresh_draft, PROMPT + [r["token"] for r in run][:row["position"] - 1], CONFIGURED)
        x = before["token"]
        assert row["draw_q"] == pytest.approx(float(q[x]), abs=1e-6) == pytest.approx(before["token_q"], abs=1e-6)
        assert row["draw_rank"] == int((q > q[x]).sum())
        assert row["draw_top"] == pytest.approx(float(q.max()), abs=1e-6)
    assert any(r["draw_rank"] > 0 for r in rows)


def test_each_verifiers_realized_acceptance_is_the_column_it_is_stored_in() -> None:
    """Every registered verifier's exact acceptance of one drafted token x given x (its own expectation on the
    chain [x]) equals the column :func:`realized_column` names: min(1, p/q) for the token-level, block and traversal
    verifiers, p(x) for NSS; the two differ, so a verifier filed under the wrong one fails."""
    g = torch.Generator().manual_seed(4)
    p, q = torch.rand(VOCAB, generator=g) ** 3, torch.rand(VOCAB, generator=g) ** 3
    p[5] = 0.0  # a token the target never says: rejected for sure
    p, q = p / p.sum(), q / q.sum()
    names = verifier_names()
    assert set(names) == ONE_DRAFT_MIN_RATIO | ONE_DRAFT_TARGET_PROB  # a new verifier must be filed, or get its own
    verifiers = [get_verifier(n) for n in names]
    for x in range(VOCAB):
        labels = realized_labels(p, q, x, verifiers)
        assert set(labels) == {"token_q", "token_p", "realized"}  # nothing stored twice
        for verifier in verifiers:
            got = node_acceptance(verifier, [x], p, q)
            assert labels[realized_column(verifier.name)] == pytest.approx(got, abs=1e-6), (verifier.name, x)
    # negative control: NSS's acceptance is not min(1, p/q), so the two columns are distinct
    assert any(abs(node_acceptance(get_verifier("nss"), [x], p, q) - realized_labels(p, q, x, [])["realized"]) > 0.01
               for x in range(VOCAB))


def test_a_verifier_without_a_known_reduction_gets_its_own_realized_column() -> None:
    class Unfiled:  # the specinfer rule under a name neither set holds
        name = "unfiled"

        def __getattr__(self, attribute):
            return getattr(get_verifier("specinfer"), attribute)

    p, q = torch.tensor([0.2, 0.8]), torch.tensor([0.6, 0.4])
    labels = realized_labels(p, q, 0, [Unfiled()])
    assert realized_column("unfiled") == "realized_unfiled"
    assert labels["realized_unfiled"] == pytest.approx(node_acceptance(get_verifier("specinfer"), [0], p, q))


def test_a_continuation_the_target_drew_has_no_realized_acceptance() -> None:
    target, draft = _pair()
    spec = DenseSpec(continuations=1, length=4, k_max=1, source="target")
    rows = prompt_nodes(target, draft, PROMPT, SAMPLING, spec, [get_verifier("specinfer")], seed=3)
    assert all(math.isnan(r["realized"]) and r["token_p"] > 0 for r in rows)


@pytest.mark.parametrize("resume", [False, True])
def test_two_runs_of_one_shard_on_one_folder_the_second_is_refused(tmp_path, monkeypatch, resume) -> None:
    """Two copies of `dense-labels --shard 0/2` started together: while the first labels its chunks, the second is
    refused in one line (collect's shard lock), and writes nothing; the first's shards are the only ones."""
    from data_gen import dense_collection
    from data_gen.dense_collection import collect_dense

    spec = DenseSpec(continuations=1, length=3, k_max=1)
    verifiers, out = [get_verifier("specinfer")], tmp_path / "dense"
    prompts = [PROMPT, PROMPT[1:], PROMPT[2:]]
    target, draft = _pair()
    real, second = dense_collection.prompt_nodes, []

    def first_run_labelling(*args, **kwargs):
        if not second:  # the second copy, started while the first labels its first prompt
            second.append("started")
            try:
                collect_dense(target, draft, prompts, ["none"] * 3, out, _metadata(spec), spec, verifiers, 1, (0, 2),
                              resume=resume)
            except ValueError as err:
                second.append(str(err))
            else:
                second.append("it wrote its shards beside the first")
        return real(*args, **kwargs)

    monkeypatch.setattr(dense_collection, "prompt_nodes", first_run_labelling)
    summary = collect_dense(target, draft, prompts, ["none"] * 3, out, _metadata(spec), spec, verifiers, 1, (0, 2))
    assert second == ["started", f"another ddte dense-labels is writing shard 0/2 of {out}: wait for it to finish, "
                      "or choose another --output"]
    assert summary.shards_written == 2
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "dense-00000.parquet", "dense-00002.parquet",
                                                     "dense.json"]
