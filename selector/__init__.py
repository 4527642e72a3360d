"""The neural expansion selector: data module, network, objectives, offline metrics, baselines, training, export.

Nothing here runs a language model or decodes: the selector learns from the parquet data set that
``ddte collect`` writes (docs/dataset.md) and ships one ONNX file that ``decode`` loads.
"""
