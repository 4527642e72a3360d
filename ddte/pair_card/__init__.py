"""The model-card measurements of ``ddte pair-card``: ``shipped`` for the shipped pair's folder (every number in
models/README.md), ``any_pair`` for any pair YAML (the real pretrained pair's figures)."""
