"""The root-time selector: its data (the collected roots, split by prompt), network, objectives, offline metrics,
baselines, guard, training (Lightning + MLflow), evaluation, what it knows and its ONNX export."""
