"""The dense label data set: prompts of a pair's split → per-node rows (data_gen/dense.py) → parquet shards.

A HF ``datasets`` parquet data set in one folder: ``dense-NNNNN.parquet`` shards of ``prompts_per_shard`` prompts
each (written under a temporary name, then renamed), ``dense.json`` (what wrote it: the pair's fingerprint, the
kernels and sampling settings, the spec, seeds, the command) and ``README.md`` (its card: schema, command, seeds).
A run that is stopped resumes shard by shard (``resume``); ``shard=(i, N)`` takes every N-th chunk of prompts, as
``ddte collect --shard`` does, so a SLURM array or several processes share one folder.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from data_gen.dense import DenseSpec, acceptance_column, prompt_nodes
from data_gen.store import write_parquet
from decode.drafting.sampling import SamplingConfig
from decode.verifiers import Verifier

METADATA = "dense.json"
SHARD = "dense-{:05d}.parquet"
SCHEMA_VERSION = 1
SCALAR_COLUMNS = ("entropy", "top1", "top2", "beta")
ACCEPT_TEXT = ("each verifier's exact probability of accepting one of K i.i.d. one-token drafts, given the K draws "
               "(the first K of {k_max} drawn from q with the row's seed); NaN where it takes no such tree")


@dataclass
class DenseSummary:
    nodes: int
    shards_written: int
    shards_skipped: int
    seconds: float
    output: Path

    def line(self) -> str:
        rate = self.nodes / self.seconds if self.seconds > 0 else 0.0
        return (f"labelled {self.nodes} nodes in {self.seconds:.1f} s ({rate:.2f} nodes/s); {self.shards_written} "
                f"shards written, {self.shards_skipped} already there; output {self.output}")


def dense_metadata(fingerprint: str, kernels: str, spec: DenseSpec, temperatures: Sequence[float], top_p: float,
                   verifiers: Sequence[Verifier], prompts: str, num_prompts: int, seed: int, command: str,
                   first_prompt: int = 0, max_prompt_tokens: int | None = None) -> dict:
    """What determines the rows (a resumed run must match it), and what produced them. ``first_prompt``: the
    source's index of the first prompt (rows' ``prompt_id`` count from it, as a tree collection's do)."""
    return {"schema_version": SCHEMA_VERSION, "pair": fingerprint, "kernels": kernels, "spec": asdict(spec),
            "temperatures": list(temperatures), "top_p": top_p, "verifiers": [v.name for v in verifiers],
            "prompts": prompts, "first_prompt": first_prompt, "num_prompts": num_prompts,
            "max_prompt_tokens": max_prompt_tokens, "seed": seed, "command": command}


def _row_seed(seed: int, prompt: int, sampling: int) -> int:
    return (seed * 1_000_003 + prompt * 101 + sampling) % (2**63 - 1)


def collect_dense(target, draft, prompts: Sequence[list[int]], categories: Sequence[str], out: Path, metadata: dict,
                  spec: DenseSpec, verifiers: Sequence[Verifier], prompts_per_shard: int = 4,
                  shard: tuple[int, int] = (0, 1), resume: bool = False,
                  progress: Callable[[int], None] | None = None, first_prompt: int = 0) -> DenseSummary:
    """Label every prompt of this shard's chunks and write them (see the module docstring).

    Raises:
        ValueError: ``out`` holds another data set (different metadata), or holds shards without ``resume``.
    """
    start = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    _check_or_write_metadata(out, metadata, resume)
    index, count = shard
    chunks = range(0, len(prompts), prompts_per_shard)
    nodes = written = skipped = 0
    samplings = [SamplingConfig(t, metadata["top_p"]) for t in metadata["temperatures"]]
    for number, first in enumerate(chunks):
        if number % count != index:
            continue
        path = out / SHARD.format(number)
        if path.exists():
            skipped += 1
            if progress is not None:
                progress(min(prompts_per_shard, len(prompts) - first))
            continue
        rows = []
        for i in range(first, min(first + prompts_per_shard, len(prompts))):
            for s, sampling in enumerate(samplings):
                seed = _row_seed(metadata["seed"], first_prompt + i, s)
                for row in prompt_nodes(target, draft, prompts[i], sampling, spec, verifiers, seed):
                    rows.append({"prompt_id": str(first_prompt + i), "category": categories[i],
                                 "temperature": sampling.temperature, "top_p": sampling.top_p, "seed": seed, **row})
            if progress is not None:
                progress(1)
        _write(rows, path, [acceptance_column(v.name, k) for v in verifiers for k in range(1, spec.k_max + 1)])
        nodes += len(rows)
        written += 1
    return DenseSummary(nodes, written, skipped, time.perf_counter() - start, out)


def _check_or_write_metadata(out: Path, metadata: dict, resume: bool) -> None:
    path = out / METADATA
    if path.exists():
        existing = json.loads(path.read_text(encoding="utf-8"))
        same = {k: v for k, v in existing.items() if k != "command"} == \
            {k: v for k, v in metadata.items() if k != "command"}
        if not same:
            raise ValueError(f"{out} holds another dense data set ({METADATA} differs); choose a new --output")
        if not resume:
            raise ValueError(f"{out} holds a dense data set already; --resume continues it")
        return
    if any(out.glob("dense-*.parquet")):
        raise ValueError(f"{out} holds shards without {METADATA}; choose a new --output")
    _atomic_text(path, json.dumps(metadata, indent=1))
    _atomic_text(out / "README.md", dataset_card(metadata))


def _write(rows: list[dict], path: Path, label_columns: list[str]) -> None:
    from datasets import Dataset, Features, List, Value
    from datasets.utils import disable_progress_bars

    disable_progress_bars()
    features = {"prompt_id": Value("string"), "category": Value("string"), "temperature": Value("float32"),
                "top_p": Value("float32"), "seed": Value("int64"), "continuation": Value("int32"),
                "position": Value("int32"), "depth": Value("int32"), "context_length": Value("int32"),
                "token": Value("int64"), "draft_hidden": List(Value("float32"))}
    for name in (*SCALAR_COLUMNS, *label_columns):
        features[name] = Value("float32")
    write_parquet(Dataset.from_list(rows, features=Features(features)), path)


def _atomic_text(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def dataset_card(metadata: dict) -> str:
    """The data set's README: what a row is, its columns, and how it was made."""
    spec = metadata["spec"]
    accept = ", ".join(f"`accept_{v}_k1..{spec['k_max']}`" for v in metadata["verifiers"])
    return f"""# Dense per-node acceptance labels

One row per node: a position of a continuation of {spec['length']} tokens sampled from the {spec['source']}
({spec['continuations']} per prompt and temperature, sharing the prompt's prefill), {metadata['num_prompts']} prompts
of `{metadata['prompts']}` from index {metadata.get('first_prompt', 0)} (each left-truncated to its last
{metadata.get('max_prompt_tokens')} tokens),
T = {', '.join(f'{t:g}' for t in metadata['temperatures'])}, top-p {metadata['top_p']:g}.
Written by `data_gen/dense_collection.py` (ddte), schema version {metadata['schema_version']}.

| column | what |
|---|---|
| `prompt_id`, `category` | the prompt's index in the set and its category (split by prompt, never by row) |
| `temperature`, `top_p`, `seed` | the sampling setting; the seed of the prompt's continuations and draws |
| `continuation`, `position`, `token` | which continuation, the node's position in it, the token drawn there |
| `depth` | `position mod {spec['depth_cycle']}`: the node's depth from a root every {spec['depth_cycle']} tokens |
| `context_length` | tokens before the node (prompt + position) |
| `draft_hidden` | the draft's final hidden state at the node |
| `entropy`, `top1`, `top2` | the draft's law q at the node: entropy (nats), two largest probabilities |
| `beta` | 1 − TV(p, q) at the node: the probability one draft is accepted |
| {accept} | {ACCEPT_TEXT.format(k_max=spec['k_max'])} |

Pair fingerprint `{metadata['pair']}`; {metadata['kernels']}. Command: `{metadata['command']}`.
"""
