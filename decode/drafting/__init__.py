"""What a step drafts and how: (K, L1, L2) actions (``actions``), the tree they build (``tree``), drafting a delayed
tree from the draft's laws (``delayed``), turning logits into laws (``sampling``) and reproducible draws (``rng``)."""
