"""Fit an expander (expansion decided while drafting) on a collected data set and export it to one ONNX file.

At every trunk node the expander computes one signal from the draft's own state (its top probability, its entropy,
β̂ from a ridge acceptance head on its hidden state, depth and root scalars, or, with --acceptance, β̂ from an
acceptance model trained on dense labels and the marginal rule on it) and halts the trunk where the signal
falls below a threshold; there it drafts its terminal (stop, or K branches of L2 tokens). Per sampling
configuration, the signal whose best rule beats the best static tree offline by --min-gain (cross-fitted by
prompt, as `ddte analyze --expansion` reports) is kept, then refitted on all prompts; elsewhere the file falls back
to that static tree. The data set needs trunk states (schema 2). The run is logged to MLflow (experiment
`expander`) unless --no-mlflow. Decode with it: `ddte generate --expander FILE`, `ddte bench --methods
VERIFIER@expander=FILE` (bench on prompts the data set did not use: the file lists them as fit_prompts).

Examples:
  ddte expander --data data/collect/smollm2-parent-heldout --verifier traversal --output expander.onnx
  ddte bench --pair smollm2 --skip-prompts 16 --methods traversal@1,1,0 traversal@expander=expander.onnx
"""

from __future__ import annotations

import argparse

from ddte.commands.common import UserError, check_output_file, user_errors


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", required=True, help="a folder written by ddte collect (schema 2, trunk states)")
    parser.add_argument("--verifier", required=True, help="the verifier whose labels choose the rules")
    parser.add_argument("--output", required=True, help="the .onnx file to write")
    parser.add_argument("--folds", type=int, default=5, help="prompt folds of the cross-fitting")
    parser.add_argument("--min-gain", type=float, default=0.01,
                        help="relative offline gain over the best static tree a rule needs to be used")
    parser.add_argument("--acceptance", default=None,
                        help="an acceptance model (ddte acceptance) trained on other prompts: adds the signals "
                             "'acceptance' (its β̂) and 'marginal' (the marginal rule on β̂ and the step times), and "
                             "the file embeds its graph instead of the ridge head")
    from decode.policies.signals import SIGNALS, signal_names

    parser.add_argument("--signals", nargs="+", default=None, choices=list(SIGNALS),
                        help="the signals it may choose among (default: every per-node signal the data set stores "
                             f"({', '.join(signal_names())}; the draws' from schema 3 on), and learned, or with "
                             "--acceptance acceptance and marginal instead)")
    parser.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default: sqlite:///mlflow.db)")
    parser.add_argument("--no-mlflow", action="store_true", help="do not log the run to MLflow")


def run(args: argparse.Namespace) -> int:
    from ddte_core.paths import staged_file
    from ddte_core.tracking import resolve_tracking_uri
    from selector.expander.expander import fit_expander, log_expander, write_expander

    if args.folds < 2:
        raise UserError("--folds must be >= 2")
    if not 0.0 <= args.min_gain < 1.0:
        raise UserError("--min-gain must be in [0, 1)")
    with user_errors():
        tracking_uri = None if args.no_mlflow else resolve_tracking_uri(args.tracking_uri)
    output = check_output_file(args.output)
    if output.suffix != ".onnx":
        raise UserError(f"--output {output}: an ONNX file, named *.onnx")
    with user_errors():
        fitted = fit_expander(args.data, args.verifier, args.folds, args.min_gain, args.signals,
                              progress=print, acceptance=args.acceptance)
        with staged_file(output) as tmp:
            write_expander(fitted, tmp)
    print(f"wrote {output} ({output.stat().st_size / 1024:.0f} KiB): verifier {fitted.metadata.verifier}, "
          f"{len(fitted.metadata.fit_prompts)} fit prompts")
    if not args.no_mlflow:
        with user_errors(prefix="MLflow: "):
            run_id = log_expander(fitted, output, tracking_uri, args.data)
        print(f"MLflow run {run_id} (experiment expander)")
    return 0
