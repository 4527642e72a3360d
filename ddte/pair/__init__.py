"""The shipped draft/target pair: stdlib corpus and splits, prompt sets, training recipe and model card measurements.

Modules: ``corpus`` (files and held-out split), ``prompts`` (``ddte build-prompts``, ``load_prompts``), ``config``
and ``tokenizer`` (recipe pieces), ``recipe`` (``ddte train-pair``), ``card`` (``ddte pair-card``).
"""
