"""ddte_core: the bottom package, what every layer uses and nothing of ddte's own subject.

``yamlconfig`` (typed YAML configs with ``KEY=VALUE`` overrides: one config system for every command),
``registry`` (named strategies, imported only when asked for), ``tracking`` (where runs are tracked in MLflow, and
the noise kept out of their output), ``schedule`` (the one warmup-then-cosine optimiser schedule), ``paths`` and
``signals`` (the output-folder check, the staged write and SIGTERM-as-interrupt that libraries and commands share),
``distributed`` (which process of a multi-process job this is), ``tensor_files`` (the reader of self-describing
safetensors files). It imports no other ddte package, and never torch,
lightning or mlflow at import time.
"""
