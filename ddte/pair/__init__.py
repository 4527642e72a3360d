"""The shipped draft/target pair: its training recipe and its model card measurements.

Modules: ``config`` and ``tokenizer`` (recipe pieces), ``recipe`` (``ddte train-pair``), ``card``
(``ddte pair-card``). The corpus and its splits, and the prompt sets, are data_gen's (``data_gen.corpus``,
``data_gen.prompts``).
"""
