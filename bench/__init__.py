"""The benchmarks, a library under the apps (``ddte bench``, ``ddte bench-verifiers``, the pipeline's bench stage).

Modules: ``method`` (the method contract: what a bench row runs, parsed once), ``decoding`` (methods side by side
in the loop, interleaved), ``compare`` (policy rows against the best static row; which static candidate to keep),
``display`` (the table, the figure, the MLflow metrics of bench rows), ``verifiers`` (every verifier on synthetic
trees, drafted from ``bench/synthetic_pair.py``).
"""
