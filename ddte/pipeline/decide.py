"""What the pipeline deploys: the bench's static candidates per verifier and temperature, and :func:`decide`, which
keeps the training split's static choice unless a runner-up or a policy beat it beyond the bench's noise."""

from __future__ import annotations

from pathlib import Path

from bench.compare import SWITCH_LEVEL, choose_static, paired_ratio_interval
from bench.method import Method, by_method, static_rows
from decode.drafting.sampling import SamplingConfig
from decode.policies.files.sampling_table import SamplingTable


def static_candidates(metadata, sampling: list[SamplingConfig], ranking: dict[int, list[str]],
                      temperatures: list[float], count: int) -> dict[float, list[str]]:
    """Per bench temperature, the static trees to bench: the selector's fallback (the best static action of its
    training split, what it drafts wherever its guard holds) first, then the split's runners-up, ``count`` distinct
    trees in all, canonical keys.

    ``sampling`` and ``ranking``: the training run's sampling configurations and, per configuration index, its
    static ranking (:class:`selector.root.info.DataFacts`); the ranking of the configuration nearest each temperature is
    used. Without a ranking, the fallback alone.
    """
    from decode.drafting.actions import distinct_trees

    out = {}
    configurations = SamplingTable(list(zip(sampling, range(len(sampling)), strict=True))) if sampling else None
    for temperature in temperatures:
        at = SamplingConfig(temperature)
        nearest = configurations.nearest(at) if configurations is not None else None
        runners_up = ranking.get(nearest, []) if nearest is not None else []
        out[temperature] = distinct_trees([metadata.guard_table().nearest(at).action, *runners_up], count)
    return out


def keep_statics(rows: list[dict], candidates: dict[str, dict[float, list[str]]]) -> dict[tuple[str, float], tuple]:
    """Per (verifier, temperature): the index of the static candidate to keep and why
    (``choose_static`` in bench/compare.py)."""
    return {(verifier, temperature): choose_static(static_rows(rows, verifier, temperature, actions), actions)
            for verifier, by_temperature in candidates.items() for temperature, actions in by_temperature.items()}


def decide(rows: list[dict], candidates: dict[str, dict[float, list[str]]], metadata: dict,
           selectors: dict[str, Path], out: Path, kept: dict[tuple[str, float], tuple] | None = None,
           expanders: dict[str, Path] | None = None):
    """Per verifier and temperature: the static candidate :func:`keep_statics` keeps (computed here when ``kept`` is
    not given), or the faster of the selector (where its guard is on) and the expander (where it was benched) among
    those that beat that static beyond this bench's noise: a paired bootstrap interval over prompts wholly above 1, at
    :data:`~bench.compare.SWITCH_LEVEL` split over the rivals. A policy a few per cent ahead inside the noise is not
    deployed: the static tree it would replace cannot lose to itself."""
    from decode.policies.files.deployment import Choice

    kept = keep_statics(rows, candidates) if kept is None else kept
    expanders = expanders or {}
    choices = []
    for verifier, path in selectors.items():
        for temperature, actions in candidates[verifier].items():
            index, measured = kept[verifier, temperature]
            at_t = by_method(rows, temperature)
            static = at_t[Method.static(verifier, actions[index])]
            rivals = {}
            guard = metadata[verifier].guard_table().nearest(SamplingConfig(temperature))
            selector = at_t.get(Method.selector(verifier, path))
            if guard.margin is not None and selector is not None:
                rivals["selector"] = selector
            if verifier in expanders and Method.expander(verifier, expanders[verifier]) in at_t:
                rivals["expander"] = at_t[Method.expander(verifier, expanders[verifier])]
            ratios = {name: row["tokens_per_s"] / static["tokens_per_s"] for name, row in rivals.items()}
            level = 1 - (1 - SWITCH_LEVEL) / max(len(rivals), 1)  # Bonferroni over the rivals, as for runners-up
            intervals = {name: paired_ratio_interval(row, static, level=level) for name, row in rivals.items()}
            clear = [name for name, interval in intervals.items() if interval is not None and interval[0] > 1.0]
            policy = max(clear, key=ratios.get, default="static")
            reason = measured + "".join(f"; the {name} ran at {ratios[name]:.3f}× ({actions[index]}), "
                                        + _interval_clause(intervals[name], level) for name in rivals)
            if "selector" not in rivals:
                reason += ("; the selector's guard never leaves its fallback here (on validation prompts the selector "
                           "never beat it by the policy phase's cost), so it drafts the fallback")
            chosen = rivals[policy] if policy != "static" else static
            choices.append(Choice(
                verifier, float(temperature), 1.0, policy, actions[0] if policy == "selector" else actions[index],
                str(path.relative_to(out)) if policy == "selector" else None,
                chosen["tokens_per_s"], static["tokens_per_s"], reason,
                str(expanders[verifier].relative_to(out)) if policy == "expander" else None,
                guard.profile if policy == "static" else None,
            ))
    return choices


def _interval_clause(interval: tuple[float, float] | None, level: float) -> str:
    """How a policy's paired interval against the kept static reads: beyond this bench's noise or within it."""
    if interval is None:
        return "no interval (under two prompts): not deployable"
    verdict = "beyond this bench's noise" if interval[0] > 1.0 else "within this bench's noise"
    return f"{level:.0%} interval [{interval[0]:.3f}, {interval[1]:.3f}]: {verdict}"
