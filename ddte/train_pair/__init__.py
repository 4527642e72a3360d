"""The recipe that trains the shipped draft/target pair (``ddte train-pair``); loading any pair is decode/pair.py's.

Modules: ``config`` (the recipe's YAML), ``tokenizer`` (the BPE tokenizer it trains), ``recipe`` (the run). The
corpus and its splits, and the prompt sets, are data_gen's (``data_gen.corpus``, ``data_gen.prompts``); the
model-card measurements are ``ddte/pair_card/``.
"""
