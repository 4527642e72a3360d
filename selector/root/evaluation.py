"""The best checkpoint evaluated after the fit: the never-lose guard fitted on the validation split (with its
curve), the honest head-room of the test split, and the test split's plots. Each logs to the run's MLflow record;
``selector/root/train.py`` calls them in that order.
"""

from __future__ import annotations

from typing import Any


def predict(model, arrays) -> Any:
    """Scores (N, A) of the model in eval mode on a whole split (small: one pass)."""
    import torch

    from decode.policies.features import HIDDEN_NAMES

    model.eval()
    with torch.no_grad():
        inputs = [torch.from_numpy(arrays.hidden[n]) for n in HIDDEN_NAMES] + [torch.from_numpy(arrays.scalars)]
        return model.net(*inputs).numpy()


def log_plots(logger, model, test) -> dict[str, Any]:
    """Test-split plots as artifacts: predicted vs true Ê (be objective), chosen vs oracle throughput, histogram."""
    import matplotlib.pyplot as plt
    import numpy as np
    import torch

    from selector.root.metrics import action_histogram_figure, oracle_actions, predicted_vs_true_figure, row_throughput
    from selector.root.model import choose_actions

    scores = predict(model, test)
    valid = test.valid
    chosen = choose_actions(torch.from_numpy(scores), torch.from_numpy(np.where(valid, test.step_ms, 1.0)),
                            torch.from_numpy(valid), model.objective).numpy()
    oracle = oracle_actions(test.be, test.step_ms, test.per_step, test.sampling_index)
    tp = row_throughput(test.be, test.step_ms)
    verifier = model.info.data.verifier
    keys, canonical = canonical_index(model.info.data.actions)
    figures = {
        "chosen_actions.png": action_histogram_figure(
            canonical[chosen], keys, f"{verifier}: actions chosen on the test split (equivalent actions merged)",
            oracle=canonical[oracle]),
        "chosen_vs_oracle_throughput.png": predicted_vs_true_figure(
            tp[np.arange(len(chosen)), chosen], tp[np.arange(len(chosen)), oracle],
            f"{verifier}: per-root throughput (tokens/ms), test split", xlabel="same-tree oracle action (biased)",
            ylabel="chosen action"),
    }
    if model.objective == "be":
        figures["predicted_vs_true_be.png"] = predicted_vs_true_figure(
            np.where(valid, scores, np.nan), test.be, f"{verifier}: Ê[τ+1] on the test split (valid actions)")
    for name, fig in figures.items():
        logger.experiment.log_figure(logger.run_id, fig, f"plots/{name}")
        plt.close(fig)
    return {"chosen": chosen, "oracle": oracle}


def deployed_scores(model, arrays) -> Any:
    """(N, A) outputs of the exported graph (π for the policy objective, predicted Ê for be) on a whole split."""
    import torch

    from decode.policies.features import HIDDEN_NAMES

    with torch.no_grad():
        inputs = [torch.from_numpy(arrays.hidden[n]) for n in HIDDEN_NAMES] + [torch.from_numpy(arrays.scalars)]
        return model.deployed()(*inputs).numpy()


def fit_guard(logger, model, dm) -> dict[str, float]:
    """The never-lose guard (selector/root/guard.py): per sampling configuration, the fallback (best static action of
    the training split), the training split's static profile (so the running machine's latency table can re-pick the
    fallback: decode/policies/files/guard.py) and the margin fitted on the validation split, stored in
    ``model.info.fallbacks``. Logs each margin's validation curve and returns the test metrics of the guarded rule."""
    import matplotlib.pyplot as plt
    import numpy as np

    from decode.policies.features import SCALAR_NAMES
    from decode.policies.files.guard import StaticProfile
    from decode.policies.files.selector_file import Fallback
    from selector.root.guard import MarginFit, decision_values, fit_margin, guarded_choice, margin_figure
    from selector.root.metrics import offline_metrics

    facts = model.info.data
    train, val, test = dm.splits["train"], dm.splits["val"], dm.splits["test"]
    length = SCALAR_NAMES.index("context_length")
    values = {name: decision_values(deployed_scores(model, arrays), arrays.step_ms, arrays.valid, model.decision)
              for name, arrays in (("val", val), ("test", test))}
    client, run_id = logger.experiment, logger.run_id
    fallbacks, fits = [], {}
    for c, conf in enumerate(facts.sampling):
        fallback = dm.static_actions.get(c, dm.fallback_static)
        rows = val.sampling_index == c
        fit = fit_margin(values["val"][rows], val.be[rows], val.step_ms[rows], fallback, per_step=val.per_step) \
            if rows.any() else MarginFit(None, [])
        fits[c] = fit
        fitted = train.sampling_index == c  # the roots the fallback was chosen on: the profile that re-picks it
        profile = StaticProfile.from_labels(facts.actions, train.be[fitted], train.scalars[fitted, length],
                                            train.per_step).as_dict() if fitted.any() else None
        fallbacks.append(Fallback(conf.temperature, conf.top_p, facts.actions[fallback], fit.margin, profile))
        for step, (_, ratio, share) in enumerate(fit.curve):
            client.log_metric(run_id, f"guard/val_ratio/cfg{c}", ratio, step=step)
            client.log_metric(run_id, f"guard/val_leave_share/cfg{c}", share, step=step)
    model.info.fallbacks = fallbacks
    figure = margin_figure(fits, [f"T={c.temperature}, top-p={c.top_p}" for c in facts.sampling], facts.verifier)
    client.log_figure(run_id, figure, "plots/guard_margin.png")
    plt.close(figure)
    margin_by_row = [fits[int(c)].margin if int(c) in fits else None for c in test.sampling_index]
    chosen = np.array([
        guarded_choice(values["test"][i : i + 1], test.base_index[i : i + 1], margin)[0]
        for i, margin in enumerate(margin_by_row)
    ], dtype=np.int64)
    guarded = offline_metrics(chosen, test.be, test.step_ms, test.sampling_index, test.base_index, test.per_step)
    metrics = {f"guarded_{k}": v for k, v in guarded.as_dict().items() if "ratio_vs_static" in k}
    for k, v in metrics.items():
        client.log_metric(run_id, f"test/{k}", v)
    return metrics


def log_head_room(logger, dm) -> dict[str, dict]:
    """Honest head-room on the test split, per sampling configuration (data_gen/headroom.py): the same-tree oracle
    (biased), the cross-fitted oracle and the cross-fitted per-prompt static, each vs the best static action.
    Logged as MLflow metrics ``headroom/<figure>/cfg<i>``; returns them for summary.json."""
    import numpy as np

    from data_gen.headroom import head_room

    test = dm.splits["test"]
    client, run_id = logger.experiment, logger.run_id
    out = {}
    for c in np.unique(test.sampling_index):
        rows = test.sampling_index == c
        trees = None if test.be_trees is None else test.be_trees[rows]
        room = head_room(trees, test.be[rows], test.step_ms[rows], test.prompt_id[rows], per_step=test.per_step)
        out[str(int(c))] = room.as_dict()
        for name in ("same_tree_oracle", "cross_fitted_oracle", "cross_fitted_prompt_static"):
            value = getattr(room, name)
            if value is not None:
                client.log_metric(run_id, f"headroom/{name}/cfg{int(c)}", value)
    return out


def canonical_index(actions: list[str]):
    """(canonical action keys, (A,) index of each action's canonical key): equivalent trees merged for plots."""
    import numpy as np

    from decode.drafting.actions import Action

    canonical = [Action.parse(a).canonical().key for a in actions]
    keys = list(dict.fromkeys(canonical))
    return keys, np.array([keys.index(c) for c in canonical])
