"""The one door into decoding: a pair, its policies and its decoders opened in one order (after litgpt's
``LLM.load``).

Every command that decodes (generate, bench, serve, the serve load bench, the pipeline's bench) opens its models with
:func:`open_session` (one method) or :func:`open_sessions` (several on one pair); every one that runs the pair's
models itself (collect, dense-labels, bench-signals, pair-card) with :func:`open_pair`. The steps run in one order:

1. ``method``: each ``VERIFIER@SPEC`` parsed (decode/policies/spec.py), before any model loads;
2. ``pair``: the pair loaded (:class:`PairRequest`), unless the caller passes one it loaded to check it first;
3. ``policy``: each spec checked against its verifier and the pair, its file read once
   (decode/policies/build.py ``load_policy_spec``): a bad spec fails here, before anything is timed;
4. ``kernels``: both models moved to the kernel paths the request names (``auto``: this machine's fastest, measured
   once and cached; decode/models/kernel_choice.py). :func:`_apply_kernels` is the one place a pair's kernels are
   applied;
5. ``drafts``: another draft a method names (bench's ``+draft=``), loaded on the pair's draft's kernel path;
6. ``latency``: the table the policies are built on (:class:`LatencyRequest`). A table times the models on their
   kernel paths, and the machine's is cached under them, so it comes after step 4. A decoder whose policies may read
   root features without such a table gets one measured now on its own models (decode/cost/measure.py
   ``loop_table``); the decoder never measures one itself. With ``batch`` above 1 the machine's table also carries
   what a batch's passes cost beyond it (``machine_batch_cost``, measured once and cached beside it);
7. ``build``: each policy built on that table, one decoder per verifier and draft; with ``batch`` (the most
   requests decoded together, >= 1) one :class:`~decode.batch.BatchDecoder` per draft instead (each request brings
   its verifier). Both run the one decoding step, so every policy runs in either. ``VERIFIER@shared`` is built on
   the step-6 table and, in a batch, decides every sharing request's chain together (decode/policies/budget.py).

Libraries never print. What a shell prints comes back as :attr:`Session.lines`; :class:`Hooks` lets the shell hear
a line before a long measurement (``announce``) and each result line as its step ends (``report``, so the lines come
out in the order of the steps), and wrap each step (``errors``: its flag in a message).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from decode.pair import LoadedPair, load_other_draft
from decode.pair_spec import PairSpec
from decode.policies.spec import PolicySpec, parse_verifier_spec

if TYPE_CHECKING:  # the requests stay light: a command parses them before torch loads
    from decode.batch import BatchDecoder
    from decode.cost.table import LatencyTable
    from decode.engine import SpeculativeDecoder
    from decode.models.cached_lm import CachedLM
    from decode.models.kernel_choice import KernelChoice
    from decode.policies.base import PolicySource
    from decode.policies.build import LoadedPolicy
    from decode.policies.files.deployment import Deployment

STEPS = ("method", "pair", "policy", "kernels", "drafts", "latency", "build")  # in the order they run
LATENCY_SOURCES = ("machine", "fitted")  # else a latency table file


@dataclass(frozen=True)
class PairRequest:
    """Which pair to load, and how: a pair YAML (a path, a name under ``configs/pair/``, or a :class:`PairSpec` read
    already), or a ``target`` and a ``draft`` (HF folders or GGUF files; default: the shipped pair). ``dtype`` None
    or ``auto``: each model's own (a pair YAML's), else both in it; ``fast_draft``: the draft on ddte's fast forward
    where it supports the model; ``tokenizer``: a folder instead of the one found beside the target."""

    config: str | Path | PairSpec | None = None
    target: str | Path | None = None
    draft: str | Path | None = None
    tokenizer: str | Path | None = None
    device: str = "cpu"
    dtype: str | None = None
    fast_draft: bool = True

    def load(self) -> LoadedPair:
        """Both models, on the default kernels (the builder moves them), with the pair's tokenizer.

        Raises:
            ValueError: a config beside a target or a draft, or what decode/pair.py's loaders raise.
        """
        from decode.pair import DEFAULT_DRAFT, DEFAULT_TARGET, load_pair, load_pair_config, load_pair_spec

        if self.config is None:
            return load_pair(self.target or DEFAULT_TARGET, self.draft or DEFAULT_DRAFT, self.tokenizer, self.device,
                             self.dtype, self.fast_draft)
        if self.target is not None or self.draft is not None:
            raise ValueError("a pair config names the target and the draft: give it, or them, not both")
        if isinstance(self.config, PairSpec):
            return load_pair_spec(self.config, self.device, self.dtype, self.fast_draft, self.tokenizer)
        return load_pair_config(self.config, self.device, self.dtype, self.fast_draft, self.tokenizer)


@dataclass(frozen=True)
class MethodRequest:
    """One ddte method, ``VERIFIER@SPEC``: a verifier's name and a policy spec (decode/policies/spec.py); ``draft``:
    another draft folder for the pair's target to run it with (None: the pair's own)."""

    verifier: str
    spec: PolicySpec
    draft: str | None = None

    @classmethod
    def parse(cls, text: str, draft: str | None = None) -> MethodRequest:
        """From ``VERIFIER@SPEC``, verifier and spec checked together. ValueError with one line; KeyError naming the
        known verifiers for an unknown one."""
        verifier, spec = parse_verifier_spec(text)
        return cls(verifier, spec, draft)

    @property
    def text(self) -> str:
        """``VERIFIER@SPEC``, canonically spelled (the draft left out)."""
        return f"{self.verifier}@{self.spec.text}"


@dataclass(frozen=True)
class LatencyRequest:
    """The table a policy that reads one is built on (decode/policies/build.py ``needs_latency``: a selector,
    expander or policy file, whose fallbacks it picks): ``machine``, this machine's, measured once per pair, machine
    and kernel paths and cached; ``fitted``, none (each file's choices as fitted); else a latency table file of this
    pair."""

    source: str = "machine"

    def __post_init__(self) -> None:
        if not isinstance(self.source, str) or not self.source.strip():
            raise ValueError(f"a latency request is {', '.join(LATENCY_SOURCES)} or a table file, got {self.source!r}")

    def read(self, pair: LoadedPair, hooks: Hooks, batch: bool = False) -> tuple[LatencyTable | None, str]:
        """``(the table or None, the line saying which)`` on ``pair`` as it runs now. ``batch``: the table also
        prices a batch's passes; the machine's then carries this machine's batch ratios (measured once and cached
        beside it), a table file those it holds, if any.

        Raises:
            OSError: a table file that cannot be read, or a cache that cannot be written.
            ValueError: a table that does not parse, or one of another pair.
        """
        from decode.cost.measure import machine_batch_cost, machine_table
        from decode.cost.table import LatencyTable

        if self.source == "fitted":
            return None, "step times: each policy file's fallback as fitted (--latency fitted)"
        if self.source == "machine":
            table, path = machine_table(pair.target, pair.draft, pair.fingerprint(), hooks.cache_dir, hooks.announce,
                                        progress=hooks.progress)
            line = f"step times: this machine's latency table ({table.machine}), {path}"
            if batch:
                cost, cost_path = machine_batch_cost(pair.target, pair.draft, pair.fingerprint(), hooks.cache_dir,
                                                     hooks.announce, progress=hooks.progress)
                table = replace(table, batch=cost)
                line += f"; batch passes {cost_path}"
            return table, line
        table = LatencyTable.from_json(Path(self.source).read_text(encoding="utf-8"))
        table.check_pair(pair.fingerprint())
        return table, f"step times: latency table {self.source}" + (f" ({table.machine})" if table.machine else "")


@dataclass(frozen=True)
class Hooks:
    """How a caller hears the steps and wraps them (the builder prints nothing).

    Attributes:
        announce: hears one line before a measurement that may take minutes (kernels, this machine's latency table).
        report: hears each result line as its step ends (the kernels line, the step-times line).
        errors: ``errors(step, method)`` gives the context each step (one of :data:`STEPS`) runs inside; ``method``
            is the :class:`MethodRequest` a per-method step handles, else None. A shell turns a library's exception
            into its own one-line error there; None: exceptions pass unchanged.
        progress: a bar on stderr during a measurement that lasts more than a few seconds.
        cache: where the per-machine measurements are kept (None: ``ddte_core.paths.latency_cache()``).
        release: the models' stock weights given back as step ``kernels`` (and ``drafts``) makes their kernels' copies
            (decode/models/release.py): for a caller that never runs the stock models (serve, a bench without HF
            rows), which then hold their kernels' copies alone.
    """

    announce: Callable[[str], None] | None = None
    report: Callable[[str], None] | None = None
    errors: Callable[[str, MethodRequest | None], AbstractContextManager] | None = None
    progress: bool = False
    cache: Path | None = None
    release: bool = False

    def step(self, name: str, method: MethodRequest | None = None) -> AbstractContextManager:
        """The context step ``name`` runs inside."""
        return self.errors(name, method) if self.errors is not None else nullcontext()

    def tell(self, line: str) -> None:
        if self.report is not None:
            self.report(line)

    @property
    def cache_dir(self) -> Path:
        from ddte_core.paths import latency_cache

        return self.cache if self.cache is not None else latency_cache()


@dataclass(frozen=True)
class Decoding:
    """One method ready to run: its decoder (shared by the methods of one verifier and draft, as one decoder serves
    any policy and sampling) and its policy (started afresh by the decoder for every generation)."""

    method: MethodRequest
    decoder: SpeculativeDecoder | BatchDecoder  # a BatchDecoder in a session opened with a batch
    policy: PolicySource


@dataclass(frozen=True)
class Session:
    """What the builder opened.

    Attributes:
        pair: the loaded pair, its models on ``kernel_choice``'s paths.
        kernel_choice: which kernel path each model runs (decode/models/kernel_choice.py ``KernelChoice``).
        latency: the table the policies were built on; None where none reads one, or the request was ``fitted``.
        lines: what a shell prints, in order: the kernels line, then ``latency_line`` where there is one.
        latency_line: which table the policies read (``step times: ...``); None where none reads one.
        decodings: each method's decoder and policy, by method, in the order asked.
    """

    pair: LoadedPair
    kernel_choice: KernelChoice
    latency: LatencyTable | None = None
    lines: tuple[str, ...] = ()
    latency_line: str | None = None
    decodings: Mapping[MethodRequest, Decoding] = field(default_factory=dict)

    @property
    def decoding(self) -> Decoding:
        """The one method's (a session :func:`open_session` opened); ValueError for another count."""
        if len(self.decodings) != 1:
            raise ValueError(f"the session holds {len(self.decodings)} methods, not one")
        return next(iter(self.decodings.values()))

    @property
    def decoder(self) -> SpeculativeDecoder | BatchDecoder:
        return self.decoding.decoder

    @property
    def policy(self) -> PolicySource:
        return self.decoding.policy


def open_pair(pair: PairRequest | LoadedPair, kernels: str | None = None, hooks: Hooks | None = None) -> Session:
    """The pair on the kernel paths ``kernels`` names (text as ``--kernels`` takes it; None: the pair's own request,
    usually ``auto``), without a decoder: for a command that runs the models itself. Steps ``pair`` and ``kernels``
    of :func:`open_sessions`."""
    return open_sessions(pair, (), kernels, hooks=hooks)


def open_session(pair: PairRequest | LoadedPair, method: str | MethodRequest, kernels: str | None = None,
                 latency: str | LatencyRequest | None = None, *, deployment: Deployment | None = None,
                 hooks: Hooks | None = None, batch: int = 0) -> Session:
    """One method's session: ``session.decoder`` runs ``session.policy``. ``deployment``: the policy file of a
    ``policy=FILE`` spec when the caller read it already (to name its verifier before the pair loaded). The rest
    as :func:`open_sessions`."""
    hooks = hooks or Hooks()
    with hooks.step("method"):
        request = _method(method)
    path = request.spec.path
    files = {path: deployment} if deployment is not None and path is not None else {}
    return open_sessions(pair, [request], kernels, latency, deployments=files, hooks=hooks, batch=batch)


def open_sessions(pair: PairRequest | LoadedPair, methods: Sequence[str | MethodRequest], kernels: str | None = None,
                  latency: str | LatencyRequest | None = None, *, deployments: Mapping[str, Deployment] | None = None,
                  hooks: Hooks | None = None, batch: int = 0) -> Session:
    """Every method's decoder and policy on one pair, the steps in their one order (module docstring).

    ``pair``: a request, or a pair the caller loaded (through :meth:`PairRequest.load`) and checked; ``methods``:
    ``VERIFIER@SPEC`` texts or requests (a repeat is opened once); ``kernels``: as :func:`open_pair`; ``latency``:
    a :class:`LatencyRequest` or its text (None: ``machine``), read only where a method's policy reads a table;
    ``deployments``: policy files read already, by the path their spec names; ``batch``: 0, a decoder per verifier
    that decodes one request at a time; N >= 1, each method's decoder a :class:`~decode.batch.BatchDecoder` for up to
    N requests together (one per draft; it owns its models' caches from then on, so the pair's models decode only
    through it), the table pricing a batch's passes where N > 1.

    Raises:
        ValueError, KeyError, OSError: what the failing step raised, inside ``hooks.errors`` of that step; no later
            step ran.
    """
    hooks = hooks or Hooks()
    with hooks.step("method"):
        requests = list(dict.fromkeys(_method(method) for method in methods))
        latency = latency if isinstance(latency, LatencyRequest) else LatencyRequest(latency or "machine")
    if not isinstance(pair, LoadedPair):
        with hooks.step("pair"):
            pair = pair.load()
    checked = _check_policies(pair, requests, deployments or {}, hooks)
    with hooks.step("kernels"):
        choice = _apply_kernels(pair, kernels, hooks)
    hooks.tell(choice.line())
    drafts = _other_drafts(pair, requests, hooks)
    table, line = None, None
    if _needs_latency(requests):
        with hooks.step("latency"):
            table, line = latency.read(pair, hooks, batch=batch > 1)
        hooks.tell(line)
    tables = _decoder_tables(pair, checked, drafts, table, hooks)
    build = _build_batch if batch else _build
    decodings = build(pair, checked, drafts, table, tables, hooks)
    return Session(pair, choice, table, (choice.line(), line) if line else (choice.line(),), line, decodings)


def _method(method: str | MethodRequest) -> MethodRequest:
    return method if isinstance(method, MethodRequest) else MethodRequest.parse(method)


def _needs_latency(requests: Sequence[MethodRequest]) -> bool:
    from decode.policies.build import needs_latency

    return any(needs_latency(request.spec) for request in requests)


def _check_policies(pair: LoadedPair, requests: Sequence[MethodRequest], deployments: Mapping[str, Deployment],
                    hooks: Hooks) -> dict[MethodRequest, LoadedPolicy]:
    """Step ``policy``: each spec checked against its verifier and the pair, its file read once, before anything is
    timed."""
    from decode.policies.build import load_policy_spec

    checked = {}
    for request in requests:
        with hooks.step("policy", request):
            path = request.spec.path
            checked[request] = load_policy_spec(request.spec, pair, request.verifier,
                                                None if path is None else deployments.get(path))
    return checked


def _apply_kernels(pair: LoadedPair, kernels: str | None, hooks: Hooks) -> KernelChoice:
    """Step ``kernels``, the one place a pair's kernels are applied: both models moved to the paths ``kernels``
    names, ``auto`` measured once per pair and machine and cached in ``hooks.cache_dir``."""
    return pair.use_kernels(kernels, hooks.cache_dir, announce=hooks.announce, progress=hooks.progress,
                            release=hooks.release)


def _other_drafts(pair: LoadedPair, requests: Sequence[MethodRequest], hooks: Hooks) -> dict[str | None, CachedLM]:
    """Step ``drafts``: every draft the methods run, by folder (None: the pair's own); another is loaded once, on
    the path the pair's draft took at step ``kernels``."""
    drafts: dict[str | None, CachedLM] = {None: pair.draft}
    for request in requests:
        if request.draft is not None and request.draft not in drafts:  # None: the pair's own
            with hooks.step("drafts", request):
                drafts[request.draft] = load_other_draft(pair, request.draft, hooks.release)
    return drafts


def _decoder_tables(pair: LoadedPair, checked: Mapping[MethodRequest, LoadedPolicy],
                    drafts: Mapping[str | None, CachedLM], table: LatencyTable | None,
                    hooks: Hooks) -> dict[str | None, LatencyTable | None]:
    """The table each draft's decoders hold: the policies' table for the pair's own draft where there is one (it
    also prices plain decoding in a summary); else, where a policy on that draft may read root features, one measured
    now on the target and that draft (part of step ``latency``); else None."""
    from decode.cost.measure import loop_table
    from decode.policies.build import reads_root_features

    tables: dict[str | None, LatencyTable | None] = {}
    for folder, draft in drafts.items():
        tables[folder] = table if folder is None else None
        if tables[folder] is None and any(reads_root_features(loaded) for request, loaded in checked.items()
                                          if request.draft == folder):
            with hooks.step("latency"):
                tables[folder] = loop_table(pair.target, draft)
    return tables


def _build(pair: LoadedPair, checked: Mapping[MethodRequest, LoadedPolicy], drafts: Mapping[str | None, CachedLM],
           table: LatencyTable | None, tables: Mapping[str | None, LatencyTable | None],
           hooks: Hooks) -> dict[MethodRequest, Decoding]:
    """Step ``build``: each policy from what step ``policy`` read, on ``table``; one decoder per verifier and draft."""
    from decode.engine import SpeculativeDecoder
    from decode.policies.build import build_policy
    from decode.verifiers import get_verifier

    decoders: dict[tuple[str, str | None], SpeculativeDecoder] = {}
    decodings = {}
    for request, loaded in checked.items():
        key = (request.verifier, request.draft)
        with hooks.step("build", request):
            policy = build_policy(loaded, pair, request.verifier, table)
            if key not in decoders:
                decoders[key] = SpeculativeDecoder(pair.target, drafts[request.draft], get_verifier(request.verifier),
                                                   pair.eos_token_id, latency=tables[request.draft])
        decodings[request] = Decoding(request, decoders[key], policy)
    return decodings


def _build_batch(pair: LoadedPair, checked: Mapping[MethodRequest, LoadedPolicy],
                 drafts: Mapping[str | None, CachedLM], table: LatencyTable | None,
                 tables: Mapping[str | None, LatencyTable | None], hooks: Hooks) -> dict[MethodRequest, Decoding]:
    """Step ``build`` of a batched session: each policy built on ``table``, one batch decoder per draft (a request
    brings its own verifier there), holding the table its draft's policies read."""
    from decode.batch import BatchDecoder
    from decode.policies.build import build_policy

    decoders: dict[str | None, BatchDecoder] = {}
    decodings = {}
    for request, loaded in checked.items():
        with hooks.step("build", request):
            policy = build_policy(loaded, pair, request.verifier, table)
            if request.draft not in decoders:
                decoders[request.draft] = BatchDecoder(pair.target, drafts[request.draft], pair.eos_token_id,
                                                       latency=tables[request.draft])
        decodings[request] = Decoding(request, decoders[request.draft], policy)
    return decodings
