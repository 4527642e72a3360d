"""Fitting and exporting an expander (selector/expander/expander.py, `ddte expander`): the graph computes the ridge
head it was fitted as, the never-lose guard falls back where no rule wins, and the file decodes on its pair (generate)
and is refused on another verifier with one line."""

from __future__ import annotations

import numpy as np
import pytest

from selector.expander.expander import choose_signal, fit_expander, write_expander


def test_a_signal_is_kept_only_where_it_beats_the_static_tree_by_the_gain():
    offline = {"learned": 1.02, "top": 1.05, "entropy": 0.98}
    assert choose_signal(offline, 0.01) == "top"
    assert choose_signal(offline, 0.01, ["learned", "entropy"]) == "learned"
    assert choose_signal(offline, 0.03, ["learned", "entropy"]) == "static"
    assert choose_signal({"learned": 0.99, "top": 0.97, "entropy": 1.0}, 0.0) == "entropy"


@pytest.fixture(scope="module")
def learned_file(tiny_collected, tmp_path_factory):
    """An expander on the tiny collection that uses the learned head wherever it can (no gain asked)."""
    fitted = fit_expander(tiny_collected, "traversal", folds=2, min_gain=-1.0, signals=["learned"])
    path = tmp_path_factory.mktemp("expander") / "traversal.onnx"
    write_expander(fitted, path)
    return fitted, path


def test_the_graph_is_the_fitted_head_and_the_metadata_says_what_chose_it(learned_file, tiny_collected):
    import onnxruntime as ort

    from decode.policies.files.expander_file import read_expander_metadata
    from selector.expander.expansion import load_episodes
    from selector.expander.expansion_fit import fit_beta_head, predict_beta

    fitted, path = learned_file
    _, episodes, _ = load_episodes(tiny_collected, "traversal")
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for column, (_, data) in enumerate(sorted(episodes.items())):
        nodes = data.features.reshape(-1, data.features.shape[-1]).astype(np.float32)
        graph = session.run(None, {"node": nodes})[0][:, column]
        want = predict_beta(fit_beta_head(data), data).reshape(-1)
        assert np.abs(graph - want).max() < 1e-3 * max(1.0, np.abs(want).max())
    from decode.policies.features import SCALAR_NAMES
    from selector.expander.expansion import PASS_TIME_SCALARS

    root = fitted.weight.shape[0] - len(SCALAR_NAMES)
    for name in PASS_TIME_SCALARS:  # the machine's pass times never move β̂
        assert np.all(fitted.weight[root + SCALAR_NAMES.index(name)] == 0.0)
    meta = read_expander_metadata(path)
    assert meta == fitted.metadata
    assert [r.signal for r in meta.rules] == ["learned", "learned"] and meta.fit_prompts
    assert all(set(r.offline) >= {"learned", "top", "entropy", "beta", "oracle"} for r in meta.rules)


def test_the_file_decodes_on_its_pair_and_halts_while_drafting(learned_file, tiny_pair, tmp_path):
    from decode.drafting.rng import TorchRandom
    from decode.drafting.sampling import SamplingConfig
    from decode.session import PairRequest, open_session

    fitted, path = learned_file
    # as fitted (no table for the rule), and the pass times the head's root scalars read, measured by the builder
    session = open_session(PairRequest(tiny_pair / "pair.yaml"), f"traversal@expander={path}", latency="fitted")
    policy, decoder = session.policy, session.decoder
    assert session.latency is None and decoder.latency is not None
    rule = fitted.metadata.rule_table().nearest(SamplingConfig(0.7)).rule
    generation = decoder.generate([5, 6, 7, 8], 24, policy, TorchRandom(0), SamplingConfig(0.7))
    allowed = {str(rule.tree_at(d)) for d in range(rule.cap + 1)}
    clipped = {a for a in generation.stats.action_counts if a not in allowed}
    assert generation.stats.new_tokens == 24 and sum(generation.stats.action_counts.values()) - len(clipped) > 0
    assert generation.stats.network_seconds  # the head ran at trunk nodes
    assert generation.stats.seconds["policy"] > 0


def test_generate_takes_an_expander_and_refuses_one_for_another_verifier(learned_file, tiny_pair, tmp_path, capsys):
    from ddte.cli import main

    _, path = learned_file
    base = ["generate", "--pair", str(tiny_pair / "pair.yaml"), "--prompt-ids", "5,6,7", "--max-new-tokens", "6",
            "--temperature", "0.7", "--expander", str(path)]
    assert main(base + ["--verifier", "traversal"]) == 0
    assert "policy expander" in capsys.readouterr().err
    assert main(base + ["--verifier", "specinfer"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "fitted for verifier 'traversal'" in err[0]
    assert main(base + ["--verifier", "traversal", "--action", "1,2,0"]) == 2
    assert main(["generate", "--pair", str(tiny_pair / "pair.yaml"), "--prompt-ids", "5", "--expander",
                 str(tmp_path / "missing.onnx")]) == 2


def test_the_command_writes_a_static_guard_where_no_rule_wins_and_logs_to_mlflow(tiny_collected, tmp_path, capsys):
    from ddte.cli import main
    from decode.policies.files.expander_file import read_expander_metadata

    out = tmp_path / "e.onnx"
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert main(["expander", "--data", str(tiny_collected), "--verifier", "specinfer", "--output", str(out),
                 "--folds", "2", "--min-gain", "0.9", "--tracking-uri", uri]) == 0
    assert all(rule.signal == "static" for rule in read_expander_metadata(out).rules)
    assert "MLflow run" in capsys.readouterr().out
    assert main(["expander", "--data", str(tmp_path / "none"), "--verifier", "specinfer", "--output",
                 str(tmp_path / "f.onnx"), "--no-mlflow"]) == 2
    assert not (tmp_path / "f.onnx").exists()


def test_a_policy_file_can_deploy_an_expander(learned_file, tiny_pair, tmp_path):
    import shutil

    from decode.drafting.sampling import SamplingConfig
    from decode.pair import load_pair_config
    from decode.policies.build import deployed_source
    from decode.policies.expander import HaltingPolicy
    from decode.policies.files.deployment import Choice, Deployment, load_deployment

    _, path = learned_file
    (tmp_path / "expanders").mkdir()
    shutil.copy(path, tmp_path / "expanders" / "traversal.onnx")
    choices = [Choice("traversal", 0.7, 1.0, "expander", "1,0,0", expander="expanders/traversal.onnx"),
               Choice("traversal", 1.0, 1.0, "static", "1,2,0")]
    Deployment(choices, "traversal").write(tmp_path / "policy.json")
    pair = load_pair_config(tiny_pair / "pair.yaml")
    policy = deployed_source(load_deployment(tmp_path / "policy.json"), "traversal", pair)
    assert isinstance(policy.start(SamplingConfig(0.7)), HaltingPolicy)
    assert policy.start(SamplingConfig(1.0)).describe(SamplingConfig(1.0)) == "static (1,2,0)"
    broken = [Choice("traversal", 0.7, 1.0, "expander", "1,0,0")]
    Deployment(broken, "traversal").write(tmp_path / "broken.json")
    with pytest.raises(ValueError, match="without its file"):
        deployed_source(load_deployment(tmp_path / "broken.json"), "traversal", pair)


def test_each_rule_carries_machine_free_profiles_of_its_fitting_roots(learned_file, tiny_collected):
    """What lets the running machine's table re-pick the fallback (decode/policies/files/guard.py): the static profile
    is the mean Ê of every labelled action over the fitting episodes, and the rule profile's tree shares sum to one."""
    from decode.policies.files.guard import RuleProfile, StaticProfile
    from selector.expander.expansion import load_episodes

    fitted, _ = learned_file
    _, episodes, _ = load_episodes(tiny_collected, "traversal")
    for rule, (_, data) in zip(fitted.metadata.rules, sorted(episodes.items()), strict=True):
        static = StaticProfile.from_dict(rule.profile)
        labelled = np.isfinite(data.be).all(axis=(0, 1))
        per_root = np.nanmean(data.be, axis=1)[:, labelled]
        want = len(per_root) / (1.0 / per_root).sum(axis=0)  # tokens per step: the harmonic mean over roots
        assert static.actions == [a.key for a, keep in zip(data.actions, labelled, strict=True) if keep]
        assert np.allclose(static.be, want)
        assert min(static.lengths) >= data.lengths.min() and max(static.lengths) <= data.lengths.max()
        ruled = RuleProfile.from_dict(rule.rule_profile)
        assert abs(sum(ruled.trees.values()) - 1.0) < 1e-9 and ruled.min_gain == -1.0
        assert set(ruled.trees) <= {rule.rule.tree_at(d).canonical().key for d in range(rule.rule.cap + 1)}


def test_the_file_carries_its_episodes_and_each_machine_refits_the_rule_on_them(learned_file):
    """A decoder with a latency table chooses the rule and the fallback again on its own times (what the refit
    chooses per machine: tests/decode/policies/test_machine_fit.py); without a table it runs the file's rule."""
    from decode.drafting.sampling import SamplingConfig
    from decode.policies.expander import ExpanderSource
    from decode.policies.fit.machine_fit import FitSet, refit
    from tests.decode.policies.test_machine_fit import FLAT, STEEP

    fitted, path = learned_file
    fit_sets = [FitSet.from_dict(f) for f in fitted.metadata.fit_sets]
    assert len(fit_sets) == len(fitted.metadata.rules) and all("learned" in f.signals for f in fit_sets)
    hidden = fitted.metadata.draft_hidden
    sampling = SamplingConfig(fitted.metadata.rules[0].temperature)
    as_fitted = ExpanderSource(path, verifier="traversal", draft_hidden=hidden).deployed(sampling)
    assert as_fitted.refit is None and as_fitted.node_rule == fitted.metadata.rules[0]
    flat = ExpanderSource(path, verifier="traversal", draft_hidden=hidden, machine=FLAT)
    steep = ExpanderSource(path, verifier="traversal", draft_hidden=hidden, machine=STEEP)
    for policy, table in ((flat, FLAT), (steep, STEEP)):
        deployed = policy.deployed(sampling)
        assert deployed.refit == refit(fit_sets[0], table, fitted.metadata.min_gain)
        assert deployed.fallback == deployed.refit.fallback and deployed.node_rule.rule == deployed.refit.rule
    on_flat = flat.deployed(sampling)
    assert "refitted on this machine's latency table" in flat.describe(sampling)
    started = flat.start(sampling)
    assert (started.name == "static") != on_flat.runs


def test_every_shipped_expander_carries_the_fit_set_of_each_rule():
    """A shipped file without fit sets would keep its fitting machine's thresholds (the profile guard) on every CPU;
    with them the decoder refits each rule on its own latency table (decode/policies/fit/machine_fit.py)."""
    from decode.policies.files.expander_file import read_expander_metadata
    from decode.policies.fit.machine_fit import FitSet
    from tests.factories import REPO

    files = sorted((REPO / "models" / "expanders").glob("*.onnx"))
    assert files
    for path in files:
        meta = read_expander_metadata(path)
        assert len(meta.fit_sets) == len(meta.rules), path.name
        for fit in meta.fit_sets:
            fit_set = FitSet.from_dict(fit)
            assert len(set(fit_set.prompts.tolist())) >= 2, path.name  # the refit cross-fits by prompt
