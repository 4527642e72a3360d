"""Time the per-node halting signals where the drafting loop computes them, and (with --data) score cheaper ones
offline.

Cost: each variant turns one draft forward's logits into the law and the signal (top probability, entropy, Σ q²),
timed right after its own forward, the variants shuffled, one torch thread by default. The table gives medians
and what each adds over making the law alone; an expander's per-node goal is 30 µs.

Offline (--data, a collection with trunk states made with this pair): every trunk node's law is recomputed from
its stored hidden state through the draft's head, checked against the stored entropy and top probability, and
the best threshold rule on each signal is cross-fitted by prompt as in `ddte analyze --expansion` (ratios to the
best static action; the exact-β rule, which no policy may see, for scale).

Example:
  ddte bench-signals --pair smollm2 --temperature 0.6 1.0 --data data/collect/smollm2-parent-heldout
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ddte.commands.common import (
    UserError,
    add_pair_arguments,
    add_threads_argument,
    apply_threads,
    load_pair_from_args,
    open_machine_pair,
    user_errors,
)

PROMPT = "Explain how a bicycle stays upright while it is moving, in simple words."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_pair_arguments(parser)
    parser.add_argument("--temperature", type=float, nargs="+", default=[0.6], help="sampling temperatures (> 0)")
    parser.add_argument("--rounds", type=int, default=150, help="timed forwards per variant and temperature")
    parser.add_argument("--data", default=None, help="a collected data set with trunk states, made with this pair: "
                        "also score each signal's rule offline")
    parser.add_argument("--verifiers", nargs="+", default=None, help="verifiers to score offline (default: the "
                        "data set's)")
    add_threads_argument(parser)


def run(args: argparse.Namespace) -> int:
    from bench.node_signals import cost_table, time_after_forward
    from decode.drafting.sampling import SamplingConfig

    if args.rounds < 1:
        raise UserError("--rounds must be >= 1")
    with user_errors():
        samplings = [SamplingConfig(temperature=t) for t in args.temperature]
    if any(s.greedy for s in samplings):
        raise UserError("--temperature must be > 0: a greedy draft has no signal to halt on")
    data = Path(args.data) if args.data else None
    if data is not None and not data.is_dir():
        raise UserError(f"--data {data}: no such data set folder")
    if args.verifiers and data is None:
        raise UserError("--verifiers picks the verifiers of the offline scores: give --data as well")
    if data is not None and args.verifiers:  # before the timing, which takes minutes
        from data_gen.store import read_metadata

        with user_errors():
            collected = read_metadata(data)["verifiers"]
        unknown = [v for v in args.verifiers if v not in collected]
        if unknown:
            raise UserError(f"--verifiers {unknown}: the data set has {', '.join(collected)}")
    apply_threads(args.threads)
    pair = load_pair_from_args(args)
    if data is not None:
        _check_same_pair(pair, data)
    open_machine_pair(pair, args)  # this machine's kernels, the line on stderr
    ids = pair.tokenizer(PROMPT)["input_ids"] if pair.tokenizer is not None else list(range(1, 17))
    for sampling in samplings:
        with user_errors():
            times, _ = time_after_forward(pair.draft, ids, sampling, args.rounds)
        print(f"\nFrom a draft forward's logits to the law and the signal, T = {sampling.temperature:g} "
              f"({args.rounds} forwards per variant):\n")
        print(cost_table(times))
    if data is not None:
        print("\nOffline, cross-fitted by prompt (ratio to the best static action):\n")
        print(_offline_table(pair, data, args.verifiers))
    return 0


def _check_same_pair(pair, data: Path) -> None:
    from data_gen.store import read_metadata

    with user_errors():
        want = read_metadata(data).get("pair", {}).get("fingerprint")
    have = pair.fingerprint()
    if want and want != have:
        raise UserError(f"--data {data} was collected with another pair (fingerprint {want[:12]}…, this pair "
                        f"{have[:12]}…): its hidden states are not this draft's")


def _offline_table(pair, data: Path, verifiers: list[str] | None) -> str:
    import numpy as np

    from bench.node_signals import signals_from_hidden
    from data_gen.store import read_metadata
    from decode.drafting.sampling import SamplingConfig
    from decode.policies.signals import SIGNALS, TrunkArrays
    from selector.expander.expansion import load_episodes, signal_ratios

    head = pair.draft.model.get_output_embeddings().weight  # (Vs, H), or (V, H) without a draft vocabulary
    lines = ["| T | verifier | top | entropy | collision Σq² | exact β (oracle) | max \\|ΔH\\| | max \\|Δtop\\| |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    with user_errors():
        collected = read_metadata(data)["verifiers"]
        unknown = [v for v in verifiers or [] if v not in collected]
        if unknown:
            raise ValueError(f"--verifiers {unknown}: the data set has {', '.join(collected)}")
        for verifier in verifiers or collected:
            metadata, episodes, _ = load_episodes(data, verifier)
            width = int(metadata["hidden_sizes"]["draft_hidden_root"])
            for c, episode in sorted(episodes.items()):
                sampling = SamplingConfig(**metadata["sampling"][c])
                sig = signals_from_hidden(episode.features[..., :width], head, sampling)
                recomputed = TrunkArrays(sig["top"], sig["entropy"])  # the registry's forms of the recomputed laws
                ratios = signal_ratios(episode, {name: SIGNALS[name].offline(recomputed) for name in ("top", "entropy")}
                                       | {"collision": sig["collision"], "beta": episode.beta},
                                       metadata["l_max"], metadata["k_max"])
                d_entropy = float(np.nanmax(np.abs(sig["entropy"] - episode.entropy)))
                d_top = float(np.nanmax(np.abs(sig["top"] - episode.top)))
                lines.append(f"| {sampling.temperature:g} | {verifier} | {ratios['top']:.3f} | "
                             f"{ratios['entropy']:.3f} | {ratios['collision']:.3f} | {ratios['beta']:.3f} | "
                             f"{d_entropy:.3f} | {d_top:.3f} |")
    return "\n".join(lines)
