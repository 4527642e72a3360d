"""What ddte learns from collected data, by product: the root-time selector (``root/``), the expander fit
(``expander/``) and the acceptance model (``acceptance/``).

Nothing here runs a language model or decodes: each learns from the parquet data sets that ``ddte collect`` and
``ddte dense-labels`` write (docs/dataset.md) and ships one ONNX file that ``decode`` loads.
"""
