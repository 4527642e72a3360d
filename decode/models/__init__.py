"""The models a decoding loop runs: a causal LM behind a slot cache with tree attention (``cached_lm``), the fast
forward for the draft with its int8 layers (``fast_llama``), GGUF targets (``gguf``), the slot bookkeeping
(``slots``), a draft's reduced vocabulary (``draft_vocab``) and its optional steering hook (``steering``)."""
