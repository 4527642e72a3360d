"""Export a trained selector to one ONNX file with metadata and a parity check against onnxruntime.

The file holds the network (standardisation inside), the action list, the feature schema, the pair fingerprint and
the never-lose guard (fallback action and margin per sampling configuration): docs/selector.md lists the keys. It is
written to a temporary name and renamed only after the parity check passed (max |torch − onnxruntime| ≤ 1e-5 on
random and real rows), so a .onnx on disk is always whole and checked. If the checkpoint knows its MLflow run (or
--run-id is given), the model is also logged there and registered.

Examples:
  ddte export --checkpoint runs/selector/specinfer-be-<run>/best.ckpt --output selector.onnx
  ddte export --checkpoint best.ckpt --output sel.onnx --tracking-uri sqlite:///mlflow.db --run-id <run>
"""

from __future__ import annotations

import argparse

from ddte.commands.common import UserError, check_output_file, user_errors


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True, help="best.ckpt written by `ddte train`")
    parser.add_argument("--output", required=True, help="the .onnx file to write (one file, no external data)")
    parser.add_argument("--data", default=None, help="data set whose rows join the parity check "
                        "(default: the checkpoint's training data, if it is still there)")
    parser.add_argument("--tracking-uri", default=None,
                        help="MLflow tracking URI (default: the one recorded in the checkpoint)")
    parser.add_argument("--run-id", default=None, help="MLflow run to log the model under (default: the training run)")
    parser.add_argument("--no-mlflow", action="store_true", help="do not log the model to MLflow")
    parser.add_argument("--parity-rows", type=int, default=64, help="random (and real) rows in the parity check")


def run(args: argparse.Namespace) -> int:
    from decode.drafting.actions import Action
    from selector.root.export import export_selector

    if args.parity_rows < 1:
        raise UserError("--parity-rows must be >= 1")
    output = check_output_file(args.output)
    if output.suffix != ".onnx":
        raise UserError(f"--output {output}: an ONNX file, named *.onnx")
    with user_errors(ValueError, FileNotFoundError, OSError):
        result = export_selector(args.checkpoint, output, tracking_uri=args.tracking_uri, run_id=args.run_id,
                                 data_dir=args.data, log_mlflow=not args.no_mlflow, parity_rows=args.parity_rows)
    meta = result.metadata
    guards = ", ".join(f"T={f.temperature:g}: {Action.parse(f.action).canonical()}"
                       + (f" unless +{f.margin:g}" if f.margin is not None else " always") for f in meta.fallbacks)
    print(f"wrote {result.path} ({result.path.stat().st_size / 1024:.0f} KiB): {len(meta.actions)} actions, "
          f"verifier {meta.verifier}, objective {meta.objective} (decision {meta.decision}); fallback {guards}")
    print(f"parity vs torch: max abs diff {result.max_abs_diff:.2e} on {result.parity_rows['random']} random + "
          f"{result.parity_rows['real']} real rows")
    if result.mlflow_model_uri:
        print(f"MLflow model: {result.mlflow_model_uri} (run {meta.run_id})")
    return 0
