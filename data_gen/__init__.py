"""data_gen: turn prompts into the selector's training set (root features + exact labels per action)."""
