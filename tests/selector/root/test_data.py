"""The data module: prompt-level splits, train-only standardisation and baselines, NaN masking, clear errors."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pyarrow.parquet as pq
import pytest

from decode.drafting.actions import Action
from selector.root.data import SelectorDataModule, best_static_actions, split_prompts, transform_scalars
from selector.root.root_data import inspect_dataset
from selector.root.synthetic import write_synthetic_dataset


@pytest.fixture(scope="module")
def dm(synthetic_dir):
    module = SelectorDataModule(str(synthetic_dir), verifier="gbv", batch_size=16)
    module.setup("fit")
    return module


def test_split_is_by_prompt(dm):
    prompts = {name: set(arr.prompt_id.tolist()) for name, arr in dm.splits.items()}
    assert not prompts["train"] & prompts["val"]
    assert not prompts["train"] & prompts["test"]
    assert not prompts["val"] & prompts["test"]
    assert sum(len(p) for p in prompts.values()) == 20
    assert sum(len(arr) for arr in dm.splits.values()) == 20 * 12  # every root in exactly one split
    assert len(prompts["val"]) == len(prompts["test"]) == 3  # round(0.15 * 20)


def test_split_depends_only_on_seed():
    ids = np.repeat(np.array([str(i) for i in range(10)], dtype=object), 3)
    a, b = split_prompts(ids, 0.2, 0.2, seed=1), split_prompts(ids, 0.2, 0.2, seed=1)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["test"], split_prompts(ids, 0.2, 0.2, seed=2)["test"])


def test_standardisation_is_fitted_on_the_training_split_only(dm):
    norm = dm.normalisation
    train_x = transform_scalars(dm.splits["train"].scalars, norm.log_mask())
    np.testing.assert_allclose(norm.mean, train_x.mean(axis=0), rtol=1e-6)
    all_x = transform_scalars(np.concatenate([a.scalars for a in dm.splits.values()]), norm.log_mask())
    assert not np.allclose(norm.mean, all_x.mean(axis=0))
    assert norm.log1p == ["kl_p_q_prev", "kl_q_p_prev"]
    assert abs(float(norm.apply(dm.splits["train"].scalars).mean())) < 1e-5


def test_baseline_action_is_the_best_static_of_the_training_split(dm):
    expected = best_static_actions(dm.splits["train"])
    assert dm.static_actions == expected
    ranking = dm.facts().static_ranking
    for config, action in expected.items():  # the ranking the pipeline benches starts with the fallback's tree
        assert ranking[config][0] == Action.parse(dm.info.actions[action]).canonical().key
        assert len(set(ranking[config])) == len(ranking[config]) >= 2
    for arrays in dm.splits.values():
        assert all(b == expected[int(c)] for b, c in zip(arrays.base_index, arrays.sampling_index, strict=True))


def test_nan_labels_are_masked_in_batches(dm):
    batch = next(iter(dm.train_dataloader()))
    assert batch["be"].shape == batch["valid"].shape == batch["step_ms"].shape == (16, 18)
    assert batch["scalars"].shape == (16, 11) and batch["target_hidden_prev"].shape == (16, 16)
    actions = dm.info.actions
    delayed = [i for i, a in enumerate(actions) if all(int(v) > 0 for v in a.split(",")) and a[0] != "1"]
    assert delayed and not batch["valid"][:, delayed].any()  # gbv on delayed trees: never valid
    assert batch["valid"].sum() == 16 * (18 - len(delayed))
    assert not batch["be"].isnan().any()  # NaN * 0 would poison the policy loss
    assert not dm.valid_actions[delayed].any()


def test_the_facts_carry_what_export_needs(dm):
    from selector.root.info import DataFacts

    facts = dm.facts()
    assert facts.verifier == "gbv" and len(facts.actions) == 18
    assert facts.hidden_sizes == {"target_hidden_prev": 16, "draft_hidden_prev": 8, "draft_hidden_root": 8}
    assert len(facts.data_fingerprint) == 64
    assert DataFacts.from_dict(facts.to_dict()) == facts  # the checkpoint's JSON-ready form reads back whole


@pytest.mark.parametrize(
    ("breakage", "message"),
    [
        ("no_folder", "does not exist"),
        ("no_shards", "has no shards"),
        ("schema_version", "schema_version"),
        ("missing_column", "lacks column(s) scalars"),
        ("unknown_verifier", "unknown verifier 'bogus'"),
        ("unlabelled_verifier", "this data set has no labels for verifier 'nss'"),
        ("a_file", "is a file, not a data folder"),
    ],
)
def test_bad_data_folders_give_clear_errors(synthetic_dir, tmp_path, breakage, message):
    folder = tmp_path / "data"
    shutil.copytree(synthetic_dir, folder)
    verifier = "specinfer"
    if breakage == "no_folder":
        folder = tmp_path / "missing"
    elif breakage == "no_shards":
        for shard in folder.glob("shard-*.parquet"):
            shard.unlink()
    elif breakage == "schema_version":
        meta = json.loads((folder / "dataset.json").read_text())
        meta["schema_version"] = 99
        (folder / "dataset.json").write_text(json.dumps(meta))
    elif breakage == "missing_column":
        shard = sorted(folder.glob("shard-*.parquet"))[0]
        pq.write_table(pq.read_table(shard).drop_columns(["scalars"]), shard)
    elif breakage == "unknown_verifier":
        verifier = "bogus"
    elif breakage == "unlabelled_verifier":
        verifier = "nss"
    elif breakage == "a_file":
        folder = folder / "dataset.json"
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        inspect_dataset(folder, verifier)


def test_too_few_prompts_to_split(tmp_path):
    folder = write_synthetic_dataset(tmp_path / "two", n_prompts=2, roots_per_prompt=4, n_shards=1)
    module = SelectorDataModule(str(folder))
    with pytest.raises(ValueError, match="too few prompts"):
        module.setup("fit")


def test_a_steps_collection_is_scored_per_step_from_the_data_module_to_the_logged_metrics(synthetic_dir, tmp_path,
                                                                                        monkeypatch):
    """dataset.json's ``"roots": "steps"`` travels with the rows: the static baseline is the best Σ Ê / Σ T̂ and the
    module logs the metrics of that estimator (decode/cost/throughput.py), not the positions one."""
    import torch

    from decode.cost.throughput import best_static
    from selector.root.info import SelectorInfo
    from selector.root.metrics import offline_metrics
    from selector.root.model import SelectorModule

    folder = tmp_path / "steps"
    shutil.copytree(synthetic_dir, folder)
    meta = json.loads((folder / "dataset.json").read_text())
    meta["roots"] = "steps"
    (folder / "dataset.json").write_text(json.dumps(meta))
    steps = SelectorDataModule(str(folder), verifier="specinfer", batch_size=64)
    steps.setup("fit")
    assert steps.facts().per_step and all(arrays.per_step for arrays in steps.splits.values())
    train = steps.splits["train"]
    for config, action in steps.static_actions.items():
        rows = train.sampling_index == config
        be = np.where(train.valid[rows], train.be[rows], np.nan).astype(np.float64)
        assert action == best_static(be, train.step_ms[rows].astype(np.float64), per_step=True)

    torch.manual_seed(0)
    module = SelectorModule(hidden_sizes=steps.hidden_sizes, num_actions=steps.num_actions, d_proj=4,
                            mlp_hidden=[8]).eval()
    module.info = SelectorInfo(steps.facts(), module.objective, steps.normalisation.to_dict())
    assert SelectorInfo.from_dict(module.info.to_dict()).data.per_step  # the checkpoint keeps it
    logged = {}
    monkeypatch.setattr(module, "log", lambda *args, **kwargs: None)
    monkeypatch.setattr(module, "log_dict", lambda values, **kwargs: logged.update(values))
    for batch in steps.test_dataloader():
        module._eval_step("test", batch)
    chosen = torch.cat([part["chosen"] for part in module._outputs["test"]]).numpy()
    module._log_offline_metrics("test")
    test = steps.splits["test"]
    be = np.where(test.valid, test.be, np.nan)

    def scored(per_step: bool) -> dict[str, float]:
        metrics = offline_metrics(chosen, be, test.step_ms, test.sampling_index, test.base_index, per_step)
        return metrics.as_dict("test/")

    assert logged == pytest.approx(scored(True))
    assert logged["test/static_vs_oracle"] != pytest.approx(scored(False)["test/static_vs_oracle"], rel=1e-3)


def test_a_collection_without_a_root_placement_is_positions_and_an_unknown_one_is_refused(synthetic_dir, tmp_path):
    assert not inspect_dataset(synthetic_dir, "specinfer").per_step
    folder = tmp_path / "data"
    shutil.copytree(synthetic_dir, folder)
    meta = json.loads((folder / "dataset.json").read_text())
    meta["roots"] = "tokens"
    (folder / "dataset.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="roots must be one of positions, steps"):
        inspect_dataset(folder, "specinfer")
