"""Which kernel path each model of a pair runs on this machine: measured on the passes the loop runs, chosen by one
deterministic rule, cached per pair and machine, and applied.

A request (``--kernels``, a pair's ``kernels:``) is ``auto`` (measure), one path for both models, or
``target=PATH,draft=PATH`` (either may be ``auto``). The target takes only exact paths
(:attr:`decode.models.kernels.KernelPath.exact`: the same product from the same weights in the same dtype), so its
law stays its own; the draft takes any, and the verifier sees the q it ran.

Measurement (:func:`measure_paths`): for each eligible path, one prefill of :data:`PREFILL_TOKENS` random tokens, then
passes of each block size in :data:`ROLE_SHAPES` over that cache, rolled back (the tree widths a step runs; the
draft's trunk is one-token passes). :func:`choose_path` scores each path by the weighted geometric mean of its times
over the default path's, the one-token pass weighing most for the draft, and takes the lowest (ties to the earlier
path). The times and the choice are cached like the latency table (:mod:`decode.cost.measure`): keyed by the
pair's fingerprint and the machine (processor and its flags, torch threads, both dtypes), never reused elsewhere.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from decode.models.cached_lm import CachedLM
from decode.models.kernels import DEFAULT, KERNEL_PATHS, kernel_path
from decode.models.machine_cache import cached_measurement, cached_value, machine_identity

ROLES = ("target", "draft")
AUTO = "auto"
PREFILL_TOKENS = 64
# block sizes timed over the prefilled cache, and each one's weight in the score (the prefill weighs 1)
ROLE_SHAPES = {"target": {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0, 16: 1.0}, "draft": {1: 4.0, 2: 1.0, 4: 1.0, 8: 1.0}}
# how much faster (weighted geometric mean) another path must be to displace the default: timing noise under load
# reaches a few percent, and the default is F.linear, the model as its authors run it
DEFAULT_MARGIN = 0.05
PROGRESS_DELAY_S = 3.0  # a measurement shorter than this shows no bar (the shipped pair's takes about a second)


@dataclass(frozen=True)
class KernelRequest:
    """What a command asked for, per role: a path name or ``auto``."""

    target: str = AUTO
    draft: str = AUTO

    @classmethod
    def parse(cls, text: str) -> KernelRequest:
        """``auto``, ``PATH`` (both models) or ``target=PATH,draft=PATH`` (either may be left out: auto).

        Raises:
            ValueError: an unknown path or role, or a path the target may not take.
        """
        text = text.strip()
        if "=" not in text:
            request = cls(text, text)
        else:
            roles: dict[str, str] = {}
            for part in text.split(","):
                role, eq, name = part.partition("=")
                role, name = role.strip(), name.strip()
                if not eq or role not in ROLES or role in roles or not name:
                    raise ValueError(f"--kernels: {text!r} is not auto, a path, or target=PATH,draft=PATH")
                roles[role] = name
            request = cls(**roles)
        for role in ROLES:
            name = getattr(request, role)
            if name != AUTO and name not in KERNEL_PATHS:
                raise ValueError(f"--kernels: unknown kernel path {name!r} (auto or one of: {', '.join(KERNEL_PATHS)})")
        if request.target != AUTO and not KERNEL_PATHS[request.target].exact:
            raise ValueError(f"--kernels: the target takes only exact paths "
                             f"({', '.join(n for n, p in KERNEL_PATHS.items() if p.exact)}); {request.target} changes "
                             "its values (give it to the draft: draft=" + request.target + ")")
        return request

    @property
    def measures(self) -> bool:
        return AUTO in (self.target, self.draft)


@dataclass
class PathTimes:
    """One role's measured passes: ``block_ms[path][i]`` for ``shapes[i]`` tokens over a ``prefill_tokens`` cache,
    ``prefill_ms[path]`` for the prefill itself (medians, milliseconds)."""

    shapes: list[int]
    prefill_tokens: int
    block_ms: dict[str, list[float]] = field(default_factory=dict)
    prefill_ms: dict[str, float] = field(default_factory=dict)


@dataclass
class KernelChoice:
    """The path each role runs, and what was measured to choose it (a role given a fixed path has no times), with
    the paths a measured role could not run on this machine and why (``skipped[role][path]``)."""

    target: str
    draft: str
    times: dict[str, PathTimes] = field(default_factory=dict)
    machine: str = ""
    pair: str = ""
    skipped: dict[str, dict[str, str]] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> KernelChoice:
        """ValueError for a text that is no kernel choice."""
        try:
            data = json.loads(text)
            times = {role: PathTimes(**t) for role, t in data.pop("times").items()}
            choice = cls(**data, times=times)
        except (ValueError, TypeError, KeyError, AttributeError) as err:
            raise ValueError(f"not a kernel choice: {err}") from err
        for role in ROLES:
            kernel_path(getattr(choice, role))
        return choice

    def line(self) -> str:
        """One line: each role's path and, where measured, its pass times against the default path's."""
        parts = []
        for role in ROLES:
            name = getattr(self, role)
            times = self.times.get(role)
            if role == "target" and not KERNEL_PATHS[name].exact:
                parts.append(f"target {name} (a quantized target: another model than the pair's, by its opt-in)")
                continue
            if times is None or name not in times.block_ms or DEFAULT not in times.block_ms:
                parts.append(f"{role} {name}")
                continue
            i = times.shapes.index(1)
            j = times.shapes.index(max(times.shapes))
            ms, base = times.block_ms[name], times.block_ms[DEFAULT]
            parts.append(f"{role} {name} (1 token {ms[i]:.1f} ms, {times.shapes[j]} tokens {ms[j]:.1f} ms; "
                         f"default {base[i]:.1f} / {base[j]:.1f})")
        skipped = sorted({f"{name}: {reason}" for role in ROLES for name, reason in self.skipped.get(role, {}).items()})
        return "kernels: " + ", ".join(parts) + "".join(f"; skipped {text}" for text in skipped)


def eligible_paths(model: CachedLM, role: str) -> tuple[list[str], dict[str, str]]:
    """The paths ``model`` can run here, in :data:`KERNEL_PATHS` order (exact ones only for the target), and why each
    other path the role could take cannot run on this machine (``{path: reason}``)."""
    eligible, skipped = [], {}
    for name, path in KERNEL_PATHS.items():
        if not (path.exact or role == "draft"):
            continue
        reason = path.unavailable(model.dtype, model.device)
        if reason is None:
            eligible.append(name)
        else:
            skipped[name] = reason
    return eligible, skipped


def measure_paths(model: CachedLM, role: str, paths: list[str], repeats: int = 2,
                  prefill_tokens: int = PREFILL_TOKENS, tick: Callable[[], None] | None = None) -> PathTimes:
    """Time each path's passes on ``model`` (see the module docstring); leaves ``model`` on the last path and empty.
    ``tick`` is called after each round of passes (``(repeats + 1) · len(paths)`` in all: a progress bar's)."""
    shapes = list(ROLE_SHAPES[role])
    prefill_tokens = max(1, min(prefill_tokens, model.context_limit - max(shapes) - 1))
    g = torch.Generator().manual_seed(0)
    vocab = model.vocab_size
    context = torch.randint(0, vocab, (prefill_tokens,), generator=g).tolist()
    blocks = [torch.randint(0, vocab, (m,), generator=g).tolist() for m in shapes]
    times = PathTimes(shapes, prefill_tokens)
    for name in paths:
        model.use_kernel(name)
        prefill: list[float] = []
        block: list[list[float]] = [[] for _ in shapes]
        for r in range(repeats + 1):  # the first round warms the path's first calls up
            start = time.perf_counter()
            model.prefill(context)
            elapsed = time.perf_counter() - start
            if r:
                prefill.append(elapsed)
            for i, tokens in enumerate(blocks):
                start = time.perf_counter()
                model.extend_tree(tokens, [model.length - 1] * len(tokens))
                elapsed = time.perf_counter() - start
                model.commit([])
                if r:
                    block[i].append(elapsed)
            if tick is not None:
                tick()
        times.block_ms[name] = [1e3 * statistics.median(t) for t in block]
        times.prefill_ms[name] = 1e3 * statistics.median(prefill)
    model.reset()
    return times


def choose_path(times: PathTimes, role: str) -> str:
    """The measured path with the lowest score: the weighted geometric mean over the prefill and every block size of
    its time over the first measured path's (the default). Another path must beat the default by
    :data:`DEFAULT_MARGIN`: a choice within timing noise keeps the default, so a command's output never rests on a
    near-tie of two timings. Deterministic: ties go to the earlier path."""
    weights = ROLE_SHAPES[role]
    base_name = next(iter(times.block_ms))
    base, base_prefill = times.block_ms[base_name], times.prefill_ms[base_name]

    def score(name: str) -> float:
        logs = [weights[m] * math.log(t / b) for m, t, b in zip(times.shapes, times.block_ms[name], base, strict=True)]
        logs.append(math.log(times.prefill_ms[name] / base_prefill))
        return sum(logs) / (sum(weights[m] for m in times.shapes) + 1.0)

    best = min(times.block_ms, key=lambda name: (round(score(name), 9), list(times.block_ms).index(name)))
    return best if score(best) < math.log(1.0 - DEFAULT_MARGIN) else base_name


def with_target_quant(request: KernelRequest, target_quant: str | None, from_flag: bool) -> KernelRequest:
    """``request`` with a pair's ``target_quant`` (its opt-in to a quantized target: the target's path) in the
    target's place. ValueError where the request asks the target for another path (``from_flag``: it came from
    ``--kernels``, else from the pair's ``kernels:``): the opt-in names the target's path, another would be silently
    dropped."""
    if target_quant is None:
        return request
    if request.target not in (AUTO, target_quant):
        source = "--kernels" if from_flag else "the pair's kernels:"
        raise ValueError(f"{source} asks the target for {request.target}, but this pair's target_quant runs its "
                         f"target on {target_quant}: leave the target out of it (draft={request.draft}) or use the "
                         "pair without target_quant")
    return KernelRequest(target_quant, request.draft)


def check_fixed_paths(request: KernelRequest, dtypes: dict[str, torch.dtype], device: torch.device) -> None:
    """ValueError (one line naming why) for a path ``request`` fixes that its model cannot run here, the models being
    of ``dtypes`` (per role) on ``device``: asked before the models load as well as after, as it needs only these."""
    for role in ROLES:
        name = getattr(request, role)
        if name != AUTO:
            reason = kernel_path(name).unavailable(dtypes[role], device)
            if reason is not None:
                raise ValueError(f"--kernels: the {role} cannot take {name}: {reason}")


def choose_kernels(target: CachedLM, draft: CachedLM, request: KernelRequest, fingerprint: str,
                   cache: Path | None, announce: Callable[[str], None] | None = None,
                   progress: bool = False, release: bool = False) -> KernelChoice:
    """Each role's path under ``request``, measured here for the roles it says ``auto`` (read from ``cache`` when this
    pair and machine were measured before; else measured under the cache's lock and written there whole), then
    applied to both models. A role given a fixed path is not measured. ``progress`` shows a bar on stderr for a
    measurement that lasts more than a few seconds. ``release``: each model's stock weights given back as its chosen
    path's copies are made (decode/models/release.py), once nothing will measure another path: the models then run
    on their chosen paths for good.

    Raises:
        ValueError: a fixed path one of the models cannot run here (one line naming why).
    """
    identity = machine_identity(target, draft, kernels=False)
    models = {"target": target, "draft": draft}
    check_fixed_paths(request, {role: models[role].dtype for role in ROLES}, target.device)
    wanted = tuple(role for role in ROLES if getattr(request, role) == AUTO)
    measured = KernelChoice(DEFAULT, DEFAULT, machine=identity, pair=fingerprint)
    if wanted:
        def measure() -> KernelChoice:
            earlier = cached_value(cache, "kernels", fingerprint, identity, KernelChoice.from_json)
            return _measure_roles(models, wanted, _sound_part(earlier, models) if earlier else measured, progress)

        measured, _ = cached_measurement(cache, "kernels", fingerprint, identity, KernelChoice.from_json, measure,
                                         KernelChoice.to_json, announce,
                                         covers=lambda c: set(wanted) <= set(_sound_part(c, models).times))
    target_path, draft_path = (getattr(measured, role) if role in wanted else getattr(request, role) for role in ROLES)
    choice = KernelChoice(target_path, draft_path,
                          times={r: t for r, t in measured.times.items() if r in wanted}, machine=identity,
                          pair=fingerprint, skipped={r: s for r, s in measured.skipped.items() if r in wanted})
    # a release goes draft first: its preparation's temporaries (int8's float copies of a head) come while the
    # target still holds little; the target's copies then grow as its stock weights go, one matrix beyond them
    for role in ("draft", "target") if release else ROLES:
        path = getattr(choice, role)
        # a measurement leaves a model on its last path; a release prepares the chosen one again, giving back as it goes
        if models[role].kernel != path or (release and KERNEL_PATHS[path].owns_copy):
            models[role].use_kernel(path, release=release)
    return choice


def cached_refusal(choice: KernelChoice, role: str, model: CachedLM) -> str | None:
    """Why the path ``choice`` read from a cache gives ``role`` may not be applied (None when it may): a cached
    choice passes the checks a command line's request does (the target only on an exact path: its weights and dtype
    stay its own, a quantized target being the pair's ``target_quant`` opt-in, never a cache's; a path this model
    runs here), and it must be the rule's choice from the times cached beside it (:func:`choose_path`)."""
    name, times = getattr(choice, role), choice.times.get(role)
    if name not in KERNEL_PATHS:
        return f"unknown kernel path {name!r}"
    if role == "target" and not KERNEL_PATHS[name].exact:
        return f"the target takes only exact paths, not {name}"
    reason = KERNEL_PATHS[name].unavailable(model.dtype, model.device)
    if reason is not None:
        return reason
    if times is None or not times.block_ms or name not in times.block_ms or DEFAULT not in times.block_ms:
        return f"{name} was not measured"
    try:
        chosen = choose_path(times, role)
    except (ValueError, TypeError, KeyError, IndexError, ZeroDivisionError) as err:
        return f"its times do not read ({err})"
    return None if chosen == name else f"its times choose {chosen}, not {name}"


def _sound_part(choice: KernelChoice, models: dict[str, CachedLM]) -> KernelChoice:
    """``choice`` keeping only the roles whose cached path passes :func:`cached_refusal` (the others to measure)."""
    keep = [role for role in ROLES if role in choice.times and cached_refusal(choice, role, models[role]) is None]
    target_path, draft_path = (getattr(choice, role) if role in keep else DEFAULT for role in ROLES)
    return KernelChoice(target_path, draft_path,
                        times={role: choice.times[role] for role in keep}, machine=choice.machine, pair=choice.pair,
                        skipped={role: s for role, s in choice.skipped.items() if role in keep})


def _measure_roles(models: dict[str, CachedLM], wanted: tuple[str, ...], earlier: KernelChoice,
                   progress: bool) -> KernelChoice:
    """``earlier`` (a cached choice of this pair and machine, or an empty one) with each role of ``wanted`` it lacks
    measured now and chosen."""
    from tqdm import tqdm

    todo = [role for role in wanted if role not in earlier.times]
    paths = {role: eligible_paths(models[role], role) for role in todo}
    rounds = sum(3 * len(paths[role][0]) for role in todo)
    with tqdm(total=rounds, desc="kernels", unit="round", disable=not progress, delay=PROGRESS_DELAY_S,
              file=sys.stderr, leave=False) as bar:
        for role in todo:
            eligible, skipped = paths[role]
            times = measure_paths(models[role], role, eligible, tick=bar.update)
            earlier.times[role] = times
            earlier.skipped[role] = skipped
            setattr(earlier, role, choose_path(times, role))
    return earlier
