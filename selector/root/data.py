"""The selector's data: parquet shards of a collected data set (docs/dataset.md) as a LightningDataModule.

One row per root, read by selector/root/root_data.py. The module

* checks the folder when it is built (metadata, schema version, feature names, verifier, columns), so a bad
  config fails before any training starts, with a ``ValueError`` that says what is wrong;
* splits by ``prompt_id`` (never by root: roots of one prompt share context and would leak across splits);
* fits the scalar standardisation on the training split only (log1p first for heavy-tailed scalars);
* picks the baseline action a_base of each sampling configuration = the best static action on the training split;
* masks actions whose label is NaN for the chosen verifier (e.g. GBV on delayed trees) in every batch.

A batch is a dict of tensors (B = batch size, A = actions, S = scalars):
``target_hidden_prev`` (B, H_t), ``draft_hidden_prev`` (B, H_d), ``draft_hidden_root`` (B, H_d), ``scalars``
(B, S) raw, ``be`` (B, A) with invalid entries set to 0, ``valid`` (B, A) bool, ``step_ms`` (B, A), ``base_index``
(B,) long, ``sampling_index`` (B,) long.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from decode.cost.throughput import static_throughputs
from decode.drafting.actions import distinct_trees
from decode.policies.features import HIDDEN_NAMES, SCALAR_NAMES
from selector.root.info import DataFacts, sampling_configs
from selector.root.root_data import RootArrays, data_fingerprint, inspect_dataset, load_rows

# KL divergences have a long right tail (probabilities clamped at 1e-9 under top-p give values of 10-20 nats):
# log1p keeps a few extreme roots from dominating the standardised scale.
DEFAULT_LOG1P_SCALARS = ("kl_p_q_prev", "kl_q_p_prev")
SPLITS = ("train", "val", "test")
STATIC_RANKING_KEPT = 8  # distinct trees of the training split's static ranking kept in the run summary


@dataclass
class Normalisation:
    """Scalar standardisation z = (f(x) − mean) / std, f = log1p(max(x, 0)) on the ``log1p`` names, else identity."""

    names: list[str]
    log1p: list[str]
    mean: list[float]
    std: list[float]

    def log_mask(self) -> np.ndarray:
        """(S,) bool: which scalars go through log1p."""
        return np.array([n in self.log1p for n in self.names], dtype=bool)

    def apply(self, scalars: np.ndarray) -> np.ndarray:
        """Standardise raw scalars (N, S) -> (N, S) float32, the numpy twin of ``SelectorNet.standardise``."""
        x = transform_scalars(scalars, self.log_mask())
        return ((x - np.asarray(self.mean)) / np.asarray(self.std)).astype(np.float32)

    def to_dict(self) -> dict[str, Any]:
        return {
            "scalar_names": self.names,
            "log1p": self.log1p,
            "mean": self.mean,
            "std": self.std,
            "formula": "z = (f(x) - mean) / std; f(x) = log1p(max(x, 0)) for names in log1p, else x. "
            "Applied inside the model: feed RAW scalars.",
        }


# ---------------------------------------------------------------------------------------------------- fitting


def split_prompts(
    prompt_ids: np.ndarray, val_fraction: float, test_fraction: float, seed: int
) -> dict[str, np.ndarray]:
    """Row indices of train/val/test, split by prompt: every prompt's roots land in exactly one split.

    Prompts are shuffled with ``seed``; val and test get ``round(fraction · n_prompts)`` prompts, at least one each.
    """
    if not (0 < val_fraction < 1 and 0 < test_fraction < 1 and val_fraction + test_fraction < 1):
        raise ValueError(f"val_fraction ({val_fraction}) and test_fraction ({test_fraction}) must be in (0, 1) "
                         "with a sum below 1")
    prompts = np.array(sorted(set(prompt_ids.tolist())), dtype=object)
    n = len(prompts)
    n_val = max(1, round(val_fraction * n))
    n_test = max(1, round(test_fraction * n))
    if n - n_val - n_test < 1:
        raise ValueError(f"too few prompts to split: {n} prompt(s) for train, val and test (need at least 3, "
                         f"and more for fractions {val_fraction}/{test_fraction})")
    order = prompts[np.random.default_rng(seed).permutation(n)]
    groups = {"val": order[:n_val], "test": order[n_val : n_val + n_test], "train": order[n_val + n_test :]}
    return {name: np.flatnonzero(np.isin(prompt_ids, groups[name])) for name in SPLITS}


def transform_scalars(scalars: np.ndarray, log_mask: np.ndarray) -> np.ndarray:
    """f(x) of the standardisation: log1p(max(x, 0)) on the masked columns, (N, S) float64."""
    x = scalars.astype(np.float64)
    return np.where(log_mask[None, :], np.log1p(np.maximum(x, 0.0)), x)


def fit_normalisation(train_scalars: np.ndarray, log1p: Sequence[str]) -> Normalisation:
    """Mean and std of the (log1p-transformed) scalars over the TRAINING rows only (N_train, S).

    A constant scalar (e.g. top-p when every config uses 1.0) gets std 1 so it standardises to 0 instead of NaN.
    """
    unknown = [n for n in log1p if n not in SCALAR_NAMES]
    if unknown:
        raise ValueError(f"log1p_scalars: unknown scalar name(s) {', '.join(unknown)} "
                         f"(known: {', '.join(SCALAR_NAMES)})")
    norm = Normalisation(names=list(SCALAR_NAMES), log1p=list(log1p), mean=[], std=[])
    x = transform_scalars(train_scalars, norm.log_mask())
    mean, std = x.mean(axis=0), x.std(axis=0)
    std = np.where(std > 1e-6, std, 1.0)
    norm.mean, norm.std = [float(v) for v in mean], [float(v) for v in std]
    return norm


def ranked_static_actions(arrays: RootArrays) -> dict[int, list[int]]:
    """Per sampling configuration, the actions by stream throughput, best first (decode/cost/throughput.py, over
    the rows as the collection placed them: ``arrays.per_step``).

    Only actions valid on every row of the configuration are ranked (a static shape must be usable at every step).
    Ties keep the action-grid order, so the first entry is :func:`best_static_actions`'s choice.
    """
    out: dict[int, list[int]] = {}
    for config in np.unique(arrays.sampling_index):
        rows = arrays.sampling_index == config
        be = np.where(arrays.valid[rows], arrays.be[rows], np.nan).astype(np.float64)
        throughput = static_throughputs(be, arrays.step_ms[rows].astype(np.float64), arrays.per_step)
        usable = np.flatnonzero(np.isfinite(throughput))
        if not len(usable):
            raise ValueError(f"sampling config {config}: no action has a label on every root")
        out[int(config)] = [int(a) for a in usable[np.argsort(-throughput[usable], kind="stable")]]
    return out


def best_static_actions(arrays: RootArrays, ranking: dict[int, list[int]] | None = None) -> dict[int, int]:
    """a_base per sampling configuration: the action with the highest stream throughput (decode/cost/throughput.py),
    the first of ``ranking`` (:func:`ranked_static_actions` of ``arrays`` when not given)."""
    ranking = ranked_static_actions(arrays) if ranking is None else ranking
    return {config: ranked[0] for config, ranked in ranking.items()}


# ---------------------------------------------------------------------------------------------------- batches


class RootDataset(Dataset):
    """Map-style dataset whose ``__getitems__`` returns a whole batch (the DataLoader then skips per-row collation)."""

    def __init__(self, arrays: RootArrays):
        valid = arrays.valid
        self.tensors = {
            **{name: torch.from_numpy(arrays.hidden[name]) for name in HIDDEN_NAMES},
            "scalars": torch.from_numpy(arrays.scalars),
            "be": torch.from_numpy(np.where(valid, arrays.be, 0.0).astype(np.float32)),  # 0·π, never NaN·π
            "valid": torch.from_numpy(valid),
            "step_ms": torch.from_numpy(np.where(valid, arrays.step_ms, 1.0).astype(np.float32)),
            "base_index": torch.from_numpy(arrays.base_index.astype(np.int64)),
            "sampling_index": torch.from_numpy(arrays.sampling_index.astype(np.int64)),
        }

    def __len__(self) -> int:
        return int(self.tensors["scalars"].shape[0])

    def __getitems__(self, indices: list[int]) -> dict[str, torch.Tensor]:
        index = torch.as_tensor(indices, dtype=torch.long)
        return {k: v[index] for k, v in self.tensors.items()}

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.__getitems__([index])


def _keep_batch(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """collate_fn for an already-batched dict (module level so worker processes can pickle it)."""
    return batch


class SelectorDataModule(pl.LightningDataModule):
    """Root features and labels of one verifier, split by prompt, with train-only standardisation.

    Args:
        data_dir: folder written by ``ddte collect`` (dataset.json + shard-*.parquet).
        verifier: whose labels to learn (column ``be_<verifier>``); one selector per verifier.
        val_fraction, test_fraction: fractions of PROMPTS held out for validation and test.
        split_seed: seed of the prompt shuffle.
        batch_size: roots per batch.
        log1p_scalars: scalar names standardised after log1p (heavy tails); part of the exported graph.
        num_workers: DataLoader workers (0: the data is a few MB in memory, workers only add start-up time).
    """

    def __init__(
        self,
        data_dir: str,
        verifier: str = "specinfer",
        val_fraction: float = 0.15,
        test_fraction: float = 0.15,
        split_seed: int = 0,
        batch_size: int = 64,
        log1p_scalars: list[str] | None = None,
        num_workers: int = 0,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.info = inspect_dataset(data_dir, verifier)
        self.log1p_scalars = list(DEFAULT_LOG1P_SCALARS if log1p_scalars is None else log1p_scalars)
        self.splits: dict[str, RootArrays] = {}
        self.normalisation: Normalisation | None = None
        self.static_actions: dict[int, int] = {}
        self.static_ranking: dict[int, list[int]] = {}
        self.fallback_static = 0
        self.valid_actions: np.ndarray | None = None

    # Shapes the model is built with (selector/root/train.py passes them to SelectorModule).
    @property
    def hidden_sizes(self) -> dict[str, int]:
        return self.info.hidden_sizes

    @property
    def num_actions(self) -> int:
        return len(self.info.actions)

    def setup(self, stage: str | None = None) -> None:
        """Read, split, fit standardisation and baselines once (idempotent: fit, test and predict share it)."""
        if self.splits:
            return
        rows = load_rows(self.info)
        has_label = rows.valid.any(axis=1)
        if not has_label.all():  # a root with no labelled action teaches nothing and cannot be scored
            rows = rows.take(np.flatnonzero(has_label))
        index = split_prompts(rows.prompt_id, self.hparams.val_fraction, self.hparams.test_fraction,
                              self.hparams.split_seed)
        train = rows.take(index["train"])
        self.normalisation = fit_normalisation(train.scalars, self.log1p_scalars)
        self.static_ranking = ranked_static_actions(train)
        self.static_actions = best_static_actions(train, self.static_ranking)
        self.fallback_static = best_static_actions(_as_one_config(train))[0]
        self.valid_actions = train.valid.any(axis=0)
        rows.base_index = np.array([self.static_actions.get(int(c), self.fallback_static) for c in rows.sampling_index],
                                   dtype=np.int64)
        self.splits = {name: rows.take(index[name]) for name in SPLITS}

    def facts(self) -> DataFacts:
        """What the model and the exported file need to know about the data (after :meth:`setup`)."""
        return DataFacts(
            schema_version=self.info.metadata["schema_version"],
            actions=list(self.info.actions),
            hidden_sizes=dict(self.info.hidden_sizes),
            verifier=self.info.verifier,
            pair_fingerprint=self.info.pair_fingerprint,
            data_fingerprint=data_fingerprint(self.info),
            per_step=self.info.per_step,
            data_dir=str(self.info.folder.resolve()),
            sampling=sampling_configs(self.info.metadata["sampling"]),
            static_actions={k: self.info.actions[v] for k, v in self.static_actions.items()},
            # the training split's runners-up: `ddte pipeline` benches the leading distinct trees on held-out prompts
            static_ranking={k: distinct_trees([self.info.actions[a] for a in ranked], STATIC_RANKING_KEPT)
                            for k, ranked in self.static_ranking.items()},
            split_rows={name: len(arr) for name, arr in self.splits.items()},
            split_prompts={name: len(set(arr.prompt_id.tolist())) for name, arr in self.splits.items()},
            # the prompts that shaped the model or its guard; offline scores of the file must leave them out
            fit_prompts=sorted({str(p) for name in ("train", "val") for p in self.splits[name].prompt_id.tolist()}),
        )

    def _loader(self, split: str, shuffle: bool) -> DataLoader:
        self.setup()
        dataset = RootDataset(self.splits[split])
        sampler = _rank_share(dataset, self.hparams.split_seed) if shuffle else None
        return DataLoader(dataset, batch_size=self.hparams.batch_size, shuffle=shuffle and sampler is None,
                          sampler=sampler, collate_fn=_keep_batch, num_workers=self.hparams.num_workers)

    def train_dataloader(self) -> DataLoader:
        """Shuffled; with several processes each rank trains on its own share (every rank evaluates whole splits)."""
        return self._loader("train", shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader("test", shuffle=False)

    def predict_dataloader(self) -> DataLoader:
        return self._loader("test", shuffle=False)


def _rank_share(dataset: Dataset, seed: int):
    """A shuffling DistributedSampler over ``dataset`` when a process group of several ranks is up (Lightning sets
    its epoch), else None (the loader shuffles)."""
    import torch.distributed as dist
    from torch.utils.data import DistributedSampler

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return None
    return DistributedSampler(dataset, shuffle=True, seed=seed)


def _as_one_config(arrays: RootArrays) -> RootArrays:
    """The same rows with every sampling index set to 0 (for the config-agnostic fallback baseline)."""
    merged = arrays.take(np.arange(len(arrays)))
    merged.sampling_index = np.zeros(len(arrays), dtype=np.int64)
    return merged
