"""A small trained selector for the decoding tests (the module-scoped ``selector_file`` fixture of conftest.py) and
copies of it with changed metadata."""

from __future__ import annotations

import json
from pathlib import Path

import onnx

from decode.policies.selector import SelectorSource

TINY_TRAIN = Path(__file__).resolve().parents[2] / "configs" / "train" / "tiny.yaml"
HIDDEN = 32  # tiny_llama's hidden size, for both models


def train_selector_file(root: Path) -> Path:
    """A small selector trained on synthetic data with the tiny models' hidden sizes, exported to ONNX."""
    from selector.root.export import export_selector
    from selector.root.synthetic import write_synthetic_dataset
    from selector.root.train import train_selector

    data = write_synthetic_dataset(root / "data", n_prompts=10, roots_per_prompt=6, seed=1,
                                   verifiers=("specinfer",), k_max=4, l_max=2, hidden=(HIDDEN, HIDDEN))
    result = train_selector(TINY_TRAIN, [f"data.data_dir={data}", f"run.output_dir={root / 'runs'}",
                                         f"run.tracking_uri=sqlite:///{root / 'mlflow.db'}",
                                         "trainer.max_epochs=2"], verbose=False)
    exported = export_selector(result.checkpoint_path, root / "specinfer.onnx", log_mlflow=False).path
    return with_guard(exported, root / "guarded.onnx", margin=0.0)  # leave the fallback whenever it is beaten


def selector_policy(path, **changes):
    kwargs = {"verifier": "specinfer", "target_hidden": HIDDEN, "draft_hidden": HIDDEN} | changes
    return SelectorSource(path, **kwargs)


def with_metadata(path: Path, out: Path, key: str, value: str | None) -> Path:
    """A copy of the file with one metadata value replaced (None: the key removed)."""
    model = onnx.load(str(path))
    kept = [p for p in model.metadata_props if p.key != key or value is not None]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    for prop in model.metadata_props:
        if prop.key == key:
            prop.value = value
    onnx.save(model, str(out))
    return out


def with_guard(path: Path, out: Path, margin: float | None, action: str | None = None) -> Path:
    props = {p.key: p.value for p in onnx.load(str(path)).metadata_props}
    fallbacks = json.loads(props["ddte.fallbacks"])
    for f in fallbacks:
        f["margin"] = margin
        f["action"] = action or f["action"]
    return with_metadata(path, out, "ddte.fallbacks", json.dumps(fallbacks))
