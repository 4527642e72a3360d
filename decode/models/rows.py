"""The rows a forward returns: a ``last`` of an int k (the last k rows) or an index array ``(k,)`` (those rows, in
its order), as :meth:`~decode.models.cached_lm.CachedLM._forward` and the fast draft's forward take it."""

from __future__ import annotations

import numpy as np
import torch


def kept_rows(last: int | np.ndarray, device: torch.device) -> int | torch.Tensor:
    """A forward's ``last`` as HF's ``logits_to_keep`` takes it: an int k (the last k rows) as it is, an index
    array ``(k,)`` as a long tensor on ``device``."""
    return last if isinstance(last, int) else torch.as_tensor(np.asarray(last), dtype=torch.long, device=device)


def select_rows(x: torch.Tensor, last: int | np.ndarray) -> torch.Tensor:
    """The rows ``last`` names of ``x`` ``(n, ...)``: the last k for an int k, else those of the index array."""
    return x[-last:] if isinstance(last, int) else x[torch.as_tensor(np.asarray(last), dtype=torch.long,
                                                                     device=x.device)]
