"""The dense label data set: prompts of a pair's split → per-node rows (data_gen/dense.py) → parquet shards.

A HF ``datasets`` parquet data set in one folder: ``dense-NNNNN.parquet`` shards of ``prompts_per_shard`` prompts
each (written under a temporary name, then renamed), ``dense.json`` (what wrote it: the pair's fingerprint, the
kernels and sampling settings, the spec, seeds, the command) and ``README.md`` (its card: schema, command, seeds).

Chunks are global (chunk c: prompts c·prompts_per_shard onwards) and ``shard=(i, N)`` takes the chunks with
c % N == i, as ``ddte collect --shard`` does, so a SLURM array or several processes share one folder: the shards of
one data set may create or enter it in any order (the first to link ``dense.json`` into place writes it and the card;
every other one must have the same row settings, :data:`ROW_KEYS`), and a stopped run resumes chunk by chunk
(``resume``). Every check runs before the first byte is written; a shard with no chunks writes nothing. The shards,
their chunks, the metadata's link and every write are data_gen/store.py's, as for ``ddte collect``.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from data_gen.dense import (
    DRAW_COLUMNS,
    REALIZED_COLUMNS,
    DenseSpec,
    acceptance_column,
    own_realized_columns,
    prompt_nodes,
)
from data_gen.store import LOCK_PREFIX, Shards, link_json_once, shard_chunks, shard_lock, write_rows, write_text
from decode.drafting.sampling import SamplingConfig
from decode.verifiers import Verifier

METADATA = "dense.json"
SHARD = "dense-{:05d}.parquet"
SCHEMA_VERSION = 2  # 2: the drawn token's realized labels and the draw signals (1: features, β and K-draw labels)
READABLE_VERSIONS = (1, 2)  # a schema-1 set still trains on β; its rows have no realized labels and no draws
SCALAR_COLUMNS = ("entropy", "top1", "top2", "beta")
ACCEPT_TEXT = ("each verifier's exact probability of accepting one of K i.i.d. one-token drafts, given the K draws "
               "(the first K of {k_max} drawn from q with the row's seed); NaN where it takes no such tree")


CARD = "README.md"
TEMPORARY = ".tmp-"
# What decides the rows: a resumed run, or another shard, must match dense.json in each. The kernels' line (with any
# times measured to choose them) and the command are provenance, never compared.
ROW_KEYS = ("schema_version", "pair", "kernel_paths", "spec", "temperatures", "top_p", "verifiers", "prompts",
            "first_prompt", "num_prompts", "max_prompt_tokens", "seed", "prompts_per_shard")
UNRECORDED_BEFORE = ("prompts_per_shard",)  # row keys an older dense.json lacks: not held against it


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


def dense_metadata(fingerprint: str, kernels, spec: DenseSpec, temperatures: Sequence[float], top_p: float,
                   verifiers: Sequence[Verifier], prompts: str, num_prompts: int, seed: int, command: str,
                   first_prompt: int = 0, max_prompt_tokens: int | None = None, prompts_per_shard: int = 4) -> dict:
    """What determines the rows (:data:`ROW_KEYS`: a resumed run or another shard must match them), and what produced
    them. ``kernels``: the pair's KernelChoice (its path names decide the rows, its line is provenance), or None for
    the default paths. ``first_prompt``: the source's index of the first prompt (rows' ``prompt_id`` count from it,
    as a tree collection's do).

    Raises:
        ValueError: a temperature given twice, a sampling setting that is no sampling (NaN, inf, negative, top-p out
            of (0, 1]), or prompts_per_shard below 1.
    """
    temperatures = [s.temperature for s in sampling_settings(temperatures, top_p)]
    if prompts_per_shard < 1:
        raise ValueError(f"prompts_per_shard must be at least 1, got {prompts_per_shard}")
    paths = {role: getattr(kernels, role) if kernels is not None else "default" for role in ("target", "draft")}
    line = kernels.line() if kernels is not None else f"kernels: target {paths['target']}, draft {paths['draft']}"
    return {"schema_version": SCHEMA_VERSION, "pair": fingerprint, "kernels": line, "kernel_paths": paths,
            "spec": asdict(spec), "temperatures": temperatures, "top_p": top_p,
            "verifiers": [v.name for v in verifiers], "prompts": prompts, "first_prompt": first_prompt,
            "num_prompts": num_prompts, "max_prompt_tokens": max_prompt_tokens, "seed": seed,
            "prompts_per_shard": prompts_per_shard, "command": command}


def sampling_settings(temperatures: Sequence[float], top_p: float) -> list[SamplingConfig]:
    """One setting per temperature; ValueError for a temperature given twice, or a setting that is no sampling (NaN,
    inf, negative, top-p out of (0, 1])."""
    settings = [SamplingConfig(float(t), top_p) for t in temperatures]
    if len({s.temperature for s in settings}) != len(settings):
        raise ValueError(f"temperatures: give each once, got {list(temperatures)}")
    return settings


def _row_seed(seed: int, prompt: int, sampling: int) -> int:
    return (seed * 1_000_003 + prompt * 101 + sampling) % (2**63 - 1)


def collect_dense(target, draft, prompts: Sequence[list[int]], categories: Sequence[str], out: Path, metadata: dict,
                  spec: DenseSpec, verifiers: Sequence[Verifier], prompts_per_shard: int = 4,
                  shard: tuple[int, int] = (0, 1), resume: bool = False,
                  progress: Callable[[int], None] | None = None, first_prompt: int = 0) -> DenseSummary:
    """Label every prompt of this shard's chunks and write them (see the module docstring). Every check runs before
    anything is written; a shard without chunks (:func:`shard_chunks`) writes nothing and returns an empty summary.

    Raises:
        ValueError: a bad sampling setting or prompt, an output that is a file, a non-empty folder without
            ``dense.json``, one holding another data set (naming the settings that differ), or this shard's chunks
            written already without ``resume``.
    """
    start = time.perf_counter()
    samplings = sampling_settings(metadata["temperatures"], metadata["top_p"])
    if metadata.get("prompts_per_shard", prompts_per_shard) != prompts_per_shard:
        raise ValueError(f"prompts_per_shard {prompts_per_shard} is not the metadata's "
                         f"{metadata['prompts_per_shard']}")
    mine = shard_chunks(len(prompts), prompts_per_shard, shard)
    limit = min(target.context_limit, draft.context_limit)
    for number in mine:
        for i in range(number * prompts_per_shard, min((number + 1) * prompts_per_shard, len(prompts))):
            if not prompts[i] or len(prompts[i]) + spec.length + 1 > limit:
                raise ValueError(f"prompt {first_prompt + i} ({len(prompts[i])} tokens) leaves no room for "
                                 f"{spec.length} more in the {limit}-token context")
    check_dense_output(out, metadata, mine, resume)
    if not mine:
        return DenseSummary(0, 0, 0, time.perf_counter() - start, out)
    _enter_output(out, metadata)
    # two runs of one shard on one folder would both label it: the second is refused, as collect refuses it
    with shard_lock(out, shard[0], shard[1], "ddte dense-labels"):
        check_dense_output(out, metadata, mine, resume)  # the holder before us may have written them
        job = _Labelling(target, draft, prompts, categories, metadata, spec, verifiers, samplings, first_prompt)
        nodes, written, skipped = job.run(Shards(out, SHARD), mine, prompts_per_shard, progress)
    return DenseSummary(nodes, written, skipped, time.perf_counter() - start, out)


@dataclass
class _Labelling:
    """One shard's labelling: every prompt of its chunks at every sampling setting."""

    target: object
    draft: object
    prompts: Sequence[list[int]]
    categories: Sequence[str]
    metadata: dict
    spec: DenseSpec
    verifiers: Sequence[Verifier]
    samplings: list
    first_prompt: int

    def run(self, shards: Shards, mine: Sequence[int], prompts_per_shard: int,
            progress: Callable[[int], None] | None) -> tuple[int, int, int]:
        """Label and write each chunk of ``mine`` not written yet; (nodes, shards written, shards skipped)."""
        label_columns = [acceptance_column(v.name, k) for v in self.verifiers for k in range(1, self.spec.k_max + 1)]
        label_columns += own_realized_columns(self.verifiers)
        nodes = written = skipped = 0
        for number in mine:
            first = number * prompts_per_shard
            chunk = range(first, min(first + prompts_per_shard, len(self.prompts)))
            path = shards.path(number)
            if path.exists():  # resumed: done by an earlier run
                skipped += 1
                if progress is not None:
                    progress(len(chunk))
                continue
            rows = []
            for i in chunk:
                rows += self.prompt_rows(i)
                if progress is not None:
                    progress(1)
            _write(rows, path, label_columns)
            nodes += len(rows)
            written += 1
        return nodes, written, skipped

    def prompt_rows(self, i: int) -> list[dict]:
        """Prompt ``i``'s rows at every sampling setting."""
        rows, prompt_id = [], self.first_prompt + i
        for s, sampling in enumerate(self.samplings):
            seed = _row_seed(self.metadata["seed"], prompt_id, s)
            for row in prompt_nodes(self.target, self.draft, self.prompts[i], sampling, self.spec, self.verifiers,
                                    seed):
                rows.append({"prompt_id": str(prompt_id), "category": self.categories[i],
                             "temperature": sampling.temperature, "top_p": sampling.top_p, "seed": seed, **row})
        return rows


def check_dense_output(out: Path, metadata: dict, chunks: Sequence[int], resume: bool) -> None:
    """ValueError unless ``out`` may take ``chunks`` of the data set ``metadata`` describes: a new or empty folder, or
    one holding this data set (its ``dense.json`` with the same row settings) where none of ``chunks`` is written yet,
    or any of them with ``resume``. Another shard's temporaries do not count; nothing is created."""
    if not check_dense_folder(out):
        return
    check_same_dense(read_dense_metadata(out), metadata, out)
    done = Shards(out, SHARD).written(chunks)
    if done and not resume:
        raise ValueError(f"--output {out} holds this dense data set already, with {len(done)} of this shard's "
                         f"{len(chunks)} chunks written; --resume continues it")


def check_dense_folder(out: Path) -> bool:
    """Whether ``out`` holds a dense data set (its ``dense.json``); False for a new or empty folder (temporaries of a
    shard creating it do not count). ValueError for a file in the way, or a non-empty folder holding none: the
    user's own files are never written into. Nothing is created."""
    from ddte_core.paths import refuse_file_in_the_way

    refuse_file_in_the_way(out, "--output")
    if (out / METADATA).is_file():
        return True
    if out.is_dir() and any(not p.name.startswith((TEMPORARY, LOCK_PREFIX)) for p in out.iterdir()):
        raise ValueError(f"--output {out} is not empty and holds no dense data set ({METADATA}): choose a new or "
                         "empty folder")
    return False


def read_dense_metadata(out: Path) -> dict:
    path = out / METADATA
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: cannot read the dense data set's metadata ({err})") from err


def row_settings(metadata: dict) -> dict:
    """The part of ``dense.json`` that decides the rows (:data:`ROW_KEYS`); for a file written before the kernels'
    path names were recorded apart, the names read from its kernels line."""
    settings = {key: metadata.get(key) for key in ROW_KEYS}
    if "kernel_paths" not in metadata:
        line = str(metadata.get("kernels", ""))
        settings["kernel_paths"] = {role: m.group(1) for role in ("target", "draft")
                                    if (m := re.search(rf"\b{role} ([\w.-]+)", line))}
    return settings


def differing_settings(existing: dict, metadata: dict) -> list[str]:
    """Each row setting of ``metadata`` that ``existing`` holds otherwise, as ``key (there, here)`` (a dict's keys
    as ``key.sub``)."""
    old, new = row_settings(existing), row_settings(metadata)
    diff = []
    for key in ROW_KEYS:
        a, b = old[key], new[key]
        if key in UNRECORDED_BEFORE and key not in existing:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            diff += [f"{key}.{k} ({_brief(a.get(k))} there, {_brief(b.get(k))} here)" for k in sorted({*a, *b})
                     if a.get(k) != b.get(k)]
        elif a != b:
            diff.append(f"{key} ({_brief(a)} there, {_brief(b)} here)")
    return diff


def _brief(value) -> str:
    text = repr(value)
    return text if len(text) <= 24 else text[:20] + "…"


def check_same_dense(existing: dict, metadata: dict, out: Path) -> None:
    """ValueError naming the row settings in which ``out``'s data set (``existing``) differs from ``metadata``."""
    diff = differing_settings(existing, metadata)
    if diff:
        raise ValueError(f"--output {out} holds another dense data set ({METADATA} differs in: {', '.join(diff)}); "
                         "choose a new --output, or the same settings to resume")


def _enter_output(out: Path, metadata: dict) -> None:
    """Create ``out`` if new, link ``dense.json`` into place unless another shard did (theirs must match), and write
    the card where it is missing (from the ``dense.json`` on disk, so every shard writes the same one)."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"cannot create --output {out} ({err.strerror or err})") from err
    link_json_once(out / METADATA, metadata)  # the first shard's metadata wins, whole
    on_disk = read_dense_metadata(out)
    check_same_dense(on_disk, metadata, out)
    if not (out / CARD).exists():
        write_text(out / CARD, dataset_card(on_disk))


DENSE_COLUMNS = {"prompt_id": "string", "category": "string", "temperature": "float32", "top_p": "float32",
                 "seed": "int64", "continuation": "int32", "position": "int32", "depth": "int32",
                 "context_length": "int32", "token": "int64", "draft_hidden": ["float32"]}


def _write(rows: list[dict], path: Path, label_columns: list[str]) -> None:
    columns = dict.fromkeys((*SCALAR_COLUMNS, *REALIZED_COLUMNS, *DRAW_COLUMNS, *label_columns), "float32")
    write_rows(rows, {**DENSE_COLUMNS, **columns, "draw_rank": "int32"}, path)


def dataset_card(metadata: dict) -> str:
    """The data set's README: what a row is, its columns, and how it was made."""
    spec = metadata["spec"]
    accept = ", ".join(f"`accept_{v}_k1..{spec['k_max']}`" for v in metadata["verifiers"])
    realized = _realized_card(metadata) if metadata["schema_version"] >= 2 else ""
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
{realized}
Pair fingerprint `{metadata['pair']}`; {metadata['kernels']}. Command: `{metadata['command']}`.
"""


def _realized_card(metadata: dict) -> str:
    """The card's rows of the schema-2 columns: the drawn token's realized labels and the draw signals."""
    from data_gen.dense import realized_column

    by_column: dict[str, list[str]] = {}
    for name in metadata["verifiers"]:
        by_column.setdefault(realized_column(name), []).append(name)
    owners = "; ".join(f"`{column}`: {', '.join(names)}" for column, names in by_column.items())
    nan = " (NaN here: the continuations come from the target)" if metadata["spec"]["source"] == "target" else ""
    return f"""| `token_q`, `token_p` | q(x) and p(x) of the drawn token x = `token` under the row's sampling |
| `realized` | min(1, p(x)/q(x)): the realized chance the chain's verifier accepts x as a draft{nan} |
| each verifier's realized acceptance of x as a one-token draft | {owners} |
| `draw_q`, `draw_rank`, `draw_top` | the trunk's last draw before the node (x at the previous position, under its q; \
1, 0, 1 at depth 0): q, rank, that law's top probability |
"""
