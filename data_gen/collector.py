"""The collector's inner loop: one target trajectory → roots → features, union trees, exact labels → rows.

Cache discipline. Both models run the trajectory as committed tokens. At a root r (the last context token)
both caches hold positions 0..r.

The draft runs the prompt as the loop does: all but the root, then the root. A steered draft
(decode.models.steering) takes its δ from its link to the target, nothing here: the root and every union tree under the
δ of the target's states at r − 1, as in the loop; the trajectory tokens before a root under that root's δ (in the
loop each ran under the δ of its own step, which a collection that takes no steps cannot know). The labels stay exact
for the q the trees were drawn from. The draft grows the union trees as speculative slots above its tip, and the
target runs every union node in one tree pass (chunked), with the root's p already known from the
trajectory; both then drop their speculative slots and the trajectory continues for ``stride`` tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from data_gen.config import CollectConfig
from data_gen.labels import label_forest
from data_gen.schema import (
    TRUNK_COLUMNS,
    TRUNK_DRAW_COLUMNS,
    TRUNK_STATE_COLUMNS,
    acceptance_column,
    label_column,
    trees_column,
)
from data_gen.union import UnionForest, grow_union_forest
from decode.cost.table import LatencyTable, draft_passes
from decode.cost.throughput import ROOT_PLACEMENTS
from decode.drafting.actions import Action
from decode.drafting.delayed import Draw, draw_of, expand_nodes
from decode.drafting.sampling import SamplingConfig, distributions, entropy
from decode.drafting.tree import ROOT
from decode.models.cached_lm import CachedLM, run_nodes
from decode.pair import LoadedPair
from decode.policies.features import HIDDEN_NAMES, root_features
from decode.verifiers import Verifier

STEP_STREAM = 7919  # seeds the step sampling apart from the trajectory's tokens


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from integers (stable across runs, platforms and processes)."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(2, np.uint64)[0] >> np.uint64(1))


@dataclass
class TrajectoryJob:
    """One target trajectory to collect: which prompt, which sampling configuration, which repeat."""

    prompt_index: int
    prompt_ids: list[int]
    sampling_index: int
    sampling: SamplingConfig
    trajectory: int


@dataclass
class _Position:
    """What a model gave at one trajectory position: logits ``(V,)`` and final hidden state ``(H,)``."""

    logits: torch.Tensor
    hidden: torch.Tensor


class Collector:
    """Collects the rows of trajectories with one loaded pair (one instance per worker process)."""

    def __init__(
        self,
        target: CachedLM,
        draft: CachedLM,
        verifiers: Sequence[Verifier],
        actions: Sequence[Action],
        latency: LatencyTable,
        *,
        k_max: int,
        l_max: int,
        trees_per_root: int,
        new_tokens: int,
        stride: int,
        seed: int,
        target_chunk: int = 1024,
        eos_token_id: int | None = None,
        roots: str = "positions",
        reference_trunk: int = 3,
    ) -> None:
        self.target, self.draft = target, draft
        self.verifiers, self.actions, self.latency = list(verifiers), list(actions), latency
        self.passes = draft_passes(self.actions)  # Eq. 11's draft passes, built once for every root's T̂
        self.k_max, self.l_max, self.trees = k_max, l_max, trees_per_root
        self.new_tokens, self.stride, self.seed = new_tokens, stride, seed
        self.target_chunk, self.eos = target_chunk, eos_token_id
        if roots not in ROOT_PLACEMENTS:
            raise ValueError(f"roots must be one of {', '.join(ROOT_PLACEMENTS)}, not {roots!r}")
        if reference_trunk < 1:
            raise ValueError("reference_trunk must be >= 1")
        self.roots, self.reference_trunk = roots, reference_trunk
        self.context_limit = min(target.context_limit, draft.context_limit)

    def root_positions(self, prompt_length: int) -> list[int]:
        return root_positions(prompt_length, self, self.context_limit)

    def trajectory_rows(self, job: TrajectoryJob) -> list[dict]:
        """Sample one target trajectory and return one row per root (fewer if it ends at EOS)."""
        ids, sampling = list(job.prompt_ids), job.sampling
        if len(ids) < 2:
            raise ValueError("a prompt needs at least 2 tokens (a root and the token before it)")
        generator = torch.Generator().manual_seed(
            derive_seed(self.seed, job.prompt_index, job.sampling_index, job.trajectory)
        )
        t_logits, t_hidden = self.target.prefill(ids, output_hidden=True, last=2)
        target_at = [_Position(t_logits[i], t_hidden[i]) for i in (-2, -1)]
        # the draft runs the root as its own one-token pass, as it runs every later root
        d_logits, d_hidden = self.draft.prefill(ids[:-1], output_hidden=True, last=1)
        r_logits, r_hidden = self.draft.extend(ids[-1:], commit=True, output_hidden=True)
        draft_at = [_Position(d_logits[-1], d_hidden[-1]), _Position(r_logits[-1], r_hidden[-1])]
        if self.roots == "steps":
            return self._step_rows(job, len(ids), target_at, draft_at, generator)
        rows = []
        roots = self.root_positions(len(ids))
        for number, position in enumerate(roots):
            rows.append(self._root_row(job, position, target_at, draft_at))
            if number == len(roots) - 1:
                break
            new, target_at, ended = self._advance(target_at, sampling, generator, roots[number + 1] - position)
            if ended:
                break
            d_logits, d_hidden = self.draft.extend(new, commit=True, output_hidden=True)
            draft_at = (draft_at + [_Position(lg, h) for lg, h in zip(d_logits, d_hidden, strict=True)])[-2:]
        return rows

    def _step_rows(self, job: TrajectoryJob, prompt_length: int, target_at, draft_at,
                   generator: torch.Generator) -> list[dict]:
        """Rows at the starts of every ``stride``-th step of the reference chain's loop along the trajectory.

        The loop does not visit positions evenly: it starts a step where the last one ended, right after a token the
        target drew (a correction or a bonus). Given the trajectory, which tokens a chain of ``reference_trunk``
        drafted tokens would have had accepted is exact to sample token by token (:func:`accepted_as_drafted`), so
        the roots are a uniform sample of that loop's steps: the first kept step at a random offset below
        ``stride``, then every ``stride``-th. Each root stands for one step, and the stream's tokens per step is the
        roots' mean Ê (decode/cost/throughput.py).
        """
        last = last_root(prompt_length, self, self.context_limit)
        steps = torch.Generator().manual_seed(derive_seed(self.seed, job.prompt_index, job.sampling_index,
                                                          job.trajectory, STEP_STREAM))
        offset = int(torch.randint(self.stride, (1,), generator=steps))
        rows, position, step, depth = [], prompt_length - 1, 0, 0
        while True:
            if depth == 0:  # a step starts at this position
                if step % self.stride == offset:
                    rows.append(self._root_row(job, position, target_at, draft_at))
                step += 1
            if position >= last:
                return rows
            p = distributions(target_at[-1].logits, job.sampling).double().cpu()
            q = distributions(draft_at[-1].logits, job.sampling).double().cpu()
            token = int(torch.multinomial(p, 1, generator=generator))
            if token == self.eos:
                return rows
            drafted = depth < self.reference_trunk and accepted_as_drafted(p, q, token, steps)
            depth = depth + 1 if drafted else 0  # a correction or a bonus token ends the step
            logits, hidden = self.target.extend([token], commit=True, output_hidden=True)
            target_at = [target_at[-1], _Position(logits[-1], hidden[-1])]
            d_logits, d_hidden = self.draft.extend([token], commit=True, output_hidden=True)
            draft_at = [draft_at[-1], _Position(d_logits[-1], d_hidden[-1])]
            position += 1

    def _advance(self, target_at, sampling: SamplingConfig, generator: torch.Generator, steps: int):
        """Sample ``steps`` target tokens; returns them, the last two positions' outputs, and whether EOS came."""
        new = []
        for _ in range(steps):
            p = distributions(target_at[-1].logits, sampling).double().cpu()
            token = int(torch.multinomial(p, 1, generator=generator))
            new.append(token)
            if token == self.eos:
                return new, target_at, True
            logits, hidden = self.target.extend([token], commit=True, output_hidden=True)
            target_at = [target_at[-1], _Position(logits[-1], hidden[-1])]  # (previous, root)
        return new, target_at, False

    def _root_row(self, job: TrajectoryJob, position: int, target_at, draft_at) -> dict:
        sampling = job.sampling
        context_length = position + 1
        p_prev = distributions(target_at[0].logits, sampling)
        p_root = distributions(target_at[1].logits, sampling)
        q_prev = distributions(draft_at[0].logits, sampling)
        q_root = distributions(draft_at[1].logits, sampling)
        features = root_features(
            target_at[0].hidden, draft_at[0].hidden, draft_at[1].hidden, p_prev, q_prev, q_root,
            context_length, sampling, self.latency.pass_times,
        )
        seed = derive_seed(self.seed, job.prompt_index, job.sampling_index, job.trajectory, position)
        draft_hidden = {ROOT: draft_at[1].hidden}  # forest node -> the draft's final hidden state
        forest = grow_union_forest(
            q_root, self._draft_expander(sampling, draft_hidden), self.trees, self.k_max, self.l_max,
            torch.Generator().manual_seed(seed),
        )
        self.draft.commit([])
        p = self._target_rows(forest, p_root, sampling)
        q = forest.q_matrix()
        labels = label_forest(forest, p, q, self.verifiers, self.actions)
        row = {
            "prompt_id": str(job.prompt_index),
            "sampling_index": job.sampling_index,
            "temperature": float(sampling.temperature),
            "top_p": float(sampling.top_p),
            "trajectory": job.trajectory,
            "root_position": context_length,
            "seed": seed,
            HIDDEN_NAMES[0]: features.target_hidden_prev.tolist(),
            HIDDEN_NAMES[1]: features.draft_hidden_prev.tolist(),
            HIDDEN_NAMES[2]: features.draft_hidden_root.tolist(),
            "scalars": features.scalars.tolist(),
            "step_ms": self.latency.step_ms_many(context_length, self.passes).tolist(),
            "l1_by_depth": labels.l1_by_depth.tolist(),
        }
        for name, values in labels.be_trees.items():
            row[label_column(name)] = values.mean(axis=0).tolist()
            row[trees_column(name)] = values.reshape(-1).tolist()  # (s, A) tree-major
        row[TRUNK_COLUMNS[0]] = labels.trunk_accept.reshape(-1).tolist()  # (s, 2·L_max)
        row[TRUNK_COLUMNS[1]] = labels.trunk_beta.reshape(-1).tolist()
        for name, values in labels.accept.items():
            row[acceptance_column(name)] = values.tolist()
        row.update(trunk_states(forest, q, draft_hidden))
        return row

    def _draft_expander(self, sampling: SamplingConfig, hidden: dict[int, torch.Tensor] | None = None):
        """The union forest's ``expand``: one draft tree pass over new nodes whose parents were run (their final
        hidden states kept in ``hidden`` when given), as the decoding loop drafts (:func:`expand_nodes`)."""
        slots = {ROOT: self.draft.length - 1}

        def expand(forest: UnionForest, nodes: list[int]) -> torch.Tensor:
            return expand_nodes(self.draft, nodes, forest.tokens, forest.parents, slots, sampling, hidden)

        return expand

    def _target_rows(self, forest: UnionForest, p_root: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
        """``(n, V)`` target rows of the forest's nodes: the root's from the trajectory, the other internal nodes'
        from tree passes; leaves get zero rows (no label reads them, see UnionForest.internal_nodes).

        Each union sample runs as its own pass and its slots are dropped before the next: a node then attends
        over the context and its own sample (about 200 nodes) rather than the whole forest, which halves the
        tree-attention work. Nodes shared by several samples (a few percent) run again and keep their first rows.
        """
        p = torch.zeros(forest.num_nodes, p_root.numel())
        p[0] = p_root.float().cpu()
        done = {ROOT}
        for nodes in forest.sample_internal_nodes():
            todo = [v for v in nodes if v not in done]
            if not todo:
                continue
            rows = self._run_target_nodes(forest, nodes)
            index = {v: i for i, v in enumerate(nodes)}
            p[todo] = distributions(rows[[index[v] for v in todo]], sampling).cpu()
            done.update(todo)
        return p

    def _run_target_nodes(self, forest: UnionForest, nodes: list[int]) -> torch.Tensor:
        """Target logits ``(len(nodes), V)`` of ``nodes`` (non-root, closed under parents up to the root, parents
        first), in passes of at most ``target_chunk`` tokens; the cache is left with no speculative slot."""
        slots = {ROOT: self.target.length - 1}
        out = [run_nodes(self.target, nodes[start : start + self.target_chunk], forest.tokens, forest.parents, slots)
               for start in range(0, len(nodes), self.target_chunk)]
        self.target.commit([])
        return torch.cat(out)


def trunk_states(forest: UnionForest, q: torch.Tensor, hidden: dict[int, torch.Tensor]) -> dict[str, list[float]]:
    """The draft's state at trunk depths 0..L_max of every union tree (the root at depth 0): what a policy deciding
    while drafting may see there. Columns of :data:`data_gen.schema.TRUNK_STATE_COLUMNS` and
    :data:`~data_gen.schema.TRUNK_DRAW_COLUMNS` (each drawn trunk token's :func:`~decode.drafting.delayed.draw_of`,
    the loop's own), tree-major."""
    depths = forest.l_max + 1
    trunks = [sample.trunk[:depths] for sample in forest.samples]
    nodes = torch.tensor(trunks).reshape(-1)  # (s · depths,)
    rows = q[nodes]
    draws = [Draw(1.0, 0, 1.0) if d == 0 else draw_of(q[trunk[d - 1]], forest.tokens[trunk[d]])
             for trunk in trunks for d in range(depths)]
    return {
        TRUNK_STATE_COLUMNS[0]: torch.stack([hidden[int(v)] for v in nodes]).reshape(-1).tolist(),
        TRUNK_STATE_COLUMNS[1]: entropy(rows).tolist(),
        TRUNK_STATE_COLUMNS[2]: rows.max(-1).values.tolist(),
        TRUNK_DRAW_COLUMNS[0]: [d.q for d in draws],
        TRUNK_DRAW_COLUMNS[1]: [d.rank for d in draws],
        TRUNK_DRAW_COLUMNS[2]: [d.top for d in draws],
    }


def kept_probability(p: torch.Tensor, q: torch.Tensor, token: int) -> float:
    """P(the loop's output ``token`` was the draft's kept proposal | the output is ``token``).

    In a chain step the draft proposes y ~ q and keeps it with probability min(1, p(y)/q(y)), else the target draws
    from the residual; the output is p-distributed and P(kept, output = x) = min(p(x), q(x)), so given the output x
    the proposal was kept with probability min(p(x), q(x)) / p(x). ``p``, ``q`` ``(V,)`` the step's sampling laws.
    """
    p_x, q_x = float(p[token]), float(q[token])
    return min(1.0, q_x / p_x) if p_x > 0 else 0.0


def accepted_as_drafted(p: torch.Tensor, q: torch.Tensor, token: int, generator: torch.Generator) -> bool:
    """A coin of weight :func:`kept_probability`, drawn after ``token``: with it, the pair (token, kept) has the
    loop's joint law, so the step boundaries it marks along a target trajectory are the reference loop's."""
    return bool(torch.rand((), generator=generator, dtype=torch.float64) < kept_probability(p, q, token))


def root_positions(prompt_length: int, spec, context_limit: int) -> list[int]:
    """Root positions of a trajectory: the prompt's last token, then every ``spec.stride`` generated tokens.

    ``spec`` has ``new_tokens``, ``stride`` and ``l_max``. Only roots whose largest union tree (2·L_max deep)
    still fits the context window are kept.
    """
    return list(range(prompt_length - 1, last_root(prompt_length, spec, context_limit) + 1, spec.stride))


def last_root(prompt_length: int, spec, context_limit: int) -> int:
    """The last position a root may sit at: within ``spec.new_tokens`` of the prompt's end, and with room for the
    largest union tree (2·L_max deep) in the context."""
    return min(prompt_length - 1 + spec.new_tokens - 1, context_limit - 2 * spec.l_max - 2)


def load_collect_pair(config: CollectConfig) -> LoadedPair:
    """The config's pair in its device/dtype, with torch's thread count set for this worker.

    Raises:
        ValueError: the pair cannot be loaded, or it has no tokenizer (prompts are text).
    """
    from decode.models.kernels import release_stock_weights
    from decode.session import PairRequest, open_pair

    try:
        pair = PairRequest(config.pair, device=config.device, dtype=config.dtype).load()
    except ValueError as err:
        raise ValueError(f"pair: {err}") from err
    if pair.tokenizer is None:
        raise ValueError("pair: no tokenizer found (set tokenizer: in the pair config)")
    if config.threads:
        torch.set_num_threads(config.threads)
    open_pair(pair)  # the pair's kernels (auto: this machine's fastest, measured once and cached)
    release_stock_weights(pair.target.model)  # a worker never runs the stock target: its prepacked copy is enough
    return pair


def measure_collect_latency(config: CollectConfig, pair: LoadedPair) -> LatencyTable:
    """The config's latency grid measured on ``pair``, up to the largest tree of its action grid."""
    from decode.cost.measure import measure_latency

    grid = config.latency
    largest_tree = 1 + config.l_max + config.k_max * config.l_max  # the root, a full trunk and K full branches
    return measure_latency(pair.target, pair.draft, lengths=grid.lengths, sizes=grid.sizes, repeats=grid.repeats,
                           max_size=largest_tree, pair=pair.fingerprint())


def pair_facts(pair: LoadedPair, config: CollectConfig, measure: bool) -> dict:
    """What ``dataset.json`` records of a loaded pair and of the machine it runs on, from the worker that loaded it
    (in a Ray cluster the driver may have neither the device nor the libraries' versions); with ``latency`` measured
    here when ``measure`` (else None)."""
    import datasets

    from ddte_core.machine import environment

    device, env = pair.target.device, environment()
    return {
        "context_limit": pair.context_limit,
        "hidden_sizes": pair.hidden_sizes,
        "pair": {
            "fingerprint": pair.fingerprint(),
            "target": str(pair.paths["target"]),
            "draft": str(pair.paths["draft"]),
            "vocab_size": int(pair.target.vocab_size),
        },
        "versions": {
            "ddte": package_version(), "torch": env["torch"], "transformers": env["transformers"],
            "datasets": datasets.__version__, "python": env["python"],
        },
        "hardware": {
            "device": str(device), **{key: env[key] for key in ("machine", "cpu", "cores", "threads")},
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "dtype": str(pair.target.dtype).replace("torch.", ""),
        },
        "latency": measure_collect_latency(config, pair).__dict__ if measure else None,
    }


def package_version() -> str:
    """The installed ddte distribution's version ("unknown" when run from an uninstalled tree)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ddte")
    except PackageNotFoundError:
        return "unknown"

