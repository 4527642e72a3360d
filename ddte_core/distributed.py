"""Which process of a multi-process job this is (Lightning's DDP launcher, torchrun, SLURM, Ray): rank 0 alone
creates the job's tracking run and writes its outputs, and every rank draws its own training data.

Lightning's subprocess launcher re-executes the command for ranks 1..n-1 with LOCAL_RANK (and NODE_RANK) set, before
any process group exists; torchrun sets RANK, srun SLURM_PROCID. :func:`is_rank_zero` reads those until the process
group is up, then the group itself.
"""

from __future__ import annotations

import os

RANK_VARIABLES = ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID")


def _group_rank() -> int | None:
    """torch.distributed's rank once its process group is up, else None."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else None


def is_rank_zero() -> bool:
    """Whether this process is rank 0 of its job: the process group's rank 0, or before there is one, a process
    whose launcher set every rank variable it sets to 0 (a process started alone sets none)."""
    rank = _group_rank()
    if rank is not None:
        return rank == 0
    return all(int(os.environ.get(name) or 0) == 0 for name in RANK_VARIABLES)


def rank_seed(seed: int) -> int:
    """The seed of this rank's data: ``seed`` itself on rank 0 (a one-process run draws what it always drew),
    a stream of its own on every other rank of the process group."""
    rank = _group_rank() or 0
    if rank == 0:
        return seed
    import numpy as np

    return int(np.random.SeedSequence([seed, rank]).generate_state(1, np.uint64)[0] >> np.uint64(1))
