"""Decoding methods side by side on the same prompts: the engine of `ddte bench` and of the pipeline's bench stage.

A method is ``ar``, ``hf-assisted`` or ``VERIFIER@SPEC`` with SPEC a static shape ``K,L1,L2``, ``adaptive``,
``entropy``, ``selector=FILE`` or ``policy=FILE`` (ddte/commands/bench.py's help lists them). Static shapes that
draft the same tree are one method, written as their canonical (1, depth, 0) single path. Each method first runs
one warm-up prompt; then the methods run interleaved, prompt by prompt in a rotating order, so the CPU's drift
over minutes reaches all of them alike. Every prompt runs ``repeats`` times with fixed seeds
(seed + 1000·repeat + prompt index).
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from decode.actions import Action
from decode.engine import SpeculativeDecoder, check_action
from decode.pair import LoadedPair
from decode.policies import PolicyOptions, StaticPolicy, make_policy
from decode.rng import TorchRandom
from decode.sampling import SamplingConfig
from decode.stats import GenerationStats
from decode.verifiers import get_verifier

NAMED_POLICIES = ("adaptive", "entropy")


@dataclass
class BenchSettings:
    """What every method shares in one bench run."""

    max_new_tokens: int = 128
    repeats: int = 1
    seed: int = 0
    top_p: float = 1.0


@dataclass
class MethodResult:
    """One method's totals and per-prompt figures at one temperature."""

    method: str
    stats: GenerationStats
    temperature: float = 1.0
    selector_call_us: float | None = None
    per_prompt: list[dict] = field(default_factory=list)

    def row(self, ar_tps: float | None) -> dict:
        s = self.stats
        forwards = s.seconds["draft"] + s.seconds["target"] + s.seconds["prefill"]
        rates = [p["tokens_per_s"] for p in self.per_prompt]
        decode_tokens = sum(p.get("decode_tokens", 0) for p in self.per_prompt)
        decode_seconds = sum(p.get("decode_seconds", 0.0) for p in self.per_prompt)
        return {
            "method": self.method,
            "temperature": self.temperature,
            "tokens_per_s": s.tokens_per_second,
            "tokens_per_s_stdev_over_prompts": statistics.stdev(rates) if len(rates) > 1 else None,
            "speedup": s.tokens_per_second / ar_tps if ar_tps else None,
            "tpot_ms": 1000 * decode_seconds / decode_tokens if decode_tokens else None,
            "block_efficiency": s.block_efficiency if s.steps else None,
            "acceptance_rate": s.acceptance_rate if s.steps else None,
            "new_tokens": s.new_tokens,
            "target_passes": s.steps,
            "draft_tokens": s.drafted_depth,
            "accepted_tokens": s.accepted_tokens,
            "accepted_length_histogram": {str(k): v for k, v in sorted(s.accepted_counts.items())},
            "wall_seconds": s.wall_seconds,
            "outside_forwards_share": (1 - forwards / s.wall_seconds) if s.steps and s.wall_seconds else None,
            "seconds": dict(s.seconds),
            "action_histogram": {str(k): v for k, v in s.action_counts.items()},
            "selector_call_us_median": self.selector_call_us,
            "policy_share": s.seconds["policy"] / s.wall_seconds if s.steps and s.wall_seconds else None,
            "per_prompt": self.per_prompt,
        }


def canonical_method(text: str) -> str:
    """The method's canonical spelling: a static shape written as :meth:`Action.canonical`; others unchanged."""
    name, sep, spec = text.partition("@")
    if not sep or spec in NAMED_POLICIES or "=" in spec:
        return text
    try:
        return f"{name}@{Action.parse(spec).canonical().key}"
    except ValueError:
        return text


def parse_method(text: str) -> tuple[str, str | None]:
    """'ar' | 'hf-assisted' | 'VERIFIER@SPEC' -> (verifier or kind, spec); ValueError with one line if bad."""
    if text in ("ar", "hf-assisted"):
        return text, None
    name, sep, spec = text.partition("@")
    if not sep:
        raise ValueError(f"bad method '{text}': use ar, hf-assisted, VERIFIER@K,L1,L2 or VERIFIER@adaptive")
    verifier = get_verifier(name)  # KeyError names the known verifiers
    kind, _, value = spec.partition("=")
    if kind in ("selector", "policy") and value:
        if not os.path.isfile(value):
            raise ValueError(f"bad method '{text}': file {value!r} does not exist")
    elif spec not in NAMED_POLICIES:
        try:
            check_action(verifier, Action.parse(spec))
        except ValueError as err:
            raise ValueError(f"bad method '{text}': {err}") from err
    return name, spec


def unique_methods(methods: list[str]) -> tuple[list[str], list[str]]:
    """(canonical methods in first-seen order, the inputs dropped as repeats of an earlier one)."""
    kept: list[str] = []
    dropped: list[str] = []
    for method in methods:
        canonical = canonical_method(method)
        (dropped if canonical in kept else kept).append(method if canonical in kept else canonical)
    return kept, dropped


class FirstTokenClock:
    """A ``generate`` streamer that notes when the first new token arrives (its first ``put`` is the prompt)."""

    def __init__(self) -> None:
        self.puts, self.first = 0, None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def run_hf(pair: LoadedPair, ids: list[int], max_new: int, sampling: SamplingConfig, seed: int,
           assisted: bool) -> tuple[int, float, float]:
    """One HF `generate` call (target alone, or assisted by the draft); returns (new tokens, seconds, seconds to the
    first new token)."""
    torch.manual_seed(seed)
    clock = FirstTokenClock()
    kwargs = {"max_new_tokens": max_new, "do_sample": not sampling.greedy, "pad_token_id": pair.eos_token_id,
              "streamer": clock}
    if not sampling.greedy:
        kwargs.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=None)
    if assisted:
        kwargs["assistant_model"] = pair.draft.model
    start = time.perf_counter()
    with torch.inference_mode():
        out = pair.target.model.generate(torch.tensor([ids], device=pair.target.device), **kwargs)
    seconds = time.perf_counter() - start
    return out.shape[1] - len(ids), seconds, (clock.first - start) if clock.first is not None else seconds


@dataclass
class _Runner:
    """One method ready to run: ``one(ids, seed)`` generates one prompt; ``total`` accumulates its statistics."""

    method: str
    one: Callable[[list[int], int], GenerationStats]
    selector: object | None = None
    total: GenerationStats = field(default_factory=GenerationStats)
    per_prompt: list[dict] = field(default_factory=list)


def make_runner(method: str, pair: LoadedPair, settings: BenchSettings, sampling: SamplingConfig) -> _Runner:
    """A ready runner for ``method`` (ValueError for a bad method or a selector/policy file that does not fit)."""
    kind, spec = parse_method(method)
    if kind in ("ar", "hf-assisted"):
        def hf(ids: list[int], seed: int) -> GenerationStats:
            new, seconds, first = run_hf(pair, ids, settings.max_new_tokens, sampling, seed,
                                         assisted=kind == "hf-assisted")
            stats = GenerationStats(new_tokens=new, wall_seconds=seconds)
            stats.seconds["prefill"] += first  # the prompt's pass and the first token: what TPOT leaves out
            return stats

        return _Runner(method, hf)
    verifier = get_verifier(kind)
    decoder = SpeculativeDecoder(pair.target, pair.draft, verifier, sampling, pair.eos_token_id)
    fixed = None
    if spec.startswith("selector="):
        from decode.selector_policy import OnnxSelectorPolicy

        fixed = OnnxSelectorPolicy.for_pair(spec.split("=", 1)[1], verifier.name, pair, sampling)
    elif spec.startswith("policy="):
        from decode.deployment import load_deployment

        fixed = load_deployment(spec.split("=", 1)[1]).policy_for(verifier.name, sampling, pair)

    def speculative(ids: list[int], seed: int) -> GenerationStats:
        if fixed is not None:
            policy = fixed
        elif spec in NAMED_POLICIES:
            policy = make_policy(spec, PolicyOptions())
        else:
            policy = StaticPolicy(Action.parse(spec))
        return decoder.generate(ids, settings.max_new_tokens, policy, TorchRandom(seed)).stats

    return _Runner(method, speculative, fixed if hasattr(fixed, "call_seconds") else None)


def decode_time(method: str, stats: GenerationStats) -> dict[str, float]:
    """The decode phase of one generation, prefill excluded: its seconds and the tokens it produced.

    HF rows (``ar``, ``hf-assisted``) leave out the time to the first new token and that token, as vLLM's TPOT
    does; ddte rows leave out the prompt's passes, after which every token comes out of a decoding step.
    """
    hf = method in ("ar", "hf-assisted")
    tokens = stats.new_tokens - 1 if hf else stats.new_tokens
    return {"decode_seconds": stats.wall_seconds - stats.seconds["prefill"], "decode_tokens": max(tokens, 0)}


def bench_methods(methods: list[str], pair, prompts, settings: BenchSettings, sampling) -> list[MethodResult]:
    """Run every method on every prompt, interleaved: prompt by prompt, each method in turn.

    A CPU's speed drifts by 10–20 % over minutes (thermal, other tenants). Running one method's prompts after
    another's would fold that drift into the comparison; interleaving spreads it over all methods alike, and the
    order of the methods rotates from one prompt to the next so no method always runs right after the same one.
    Each method first runs one warm-up prompt (not counted).
    """
    runners = [make_runner(m, pair, settings, sampling) for m in methods]
    for runner in runners:
        runner.one(prompts[0], settings.seed)  # warm-up: first-call costs and the selector's latency table
        if runner.selector is not None:
            runner.selector.call_seconds.clear()
    rounds = [(i, r) for i in range(len(prompts)) for r in range(settings.repeats)]
    for n, (i, r) in enumerate(tqdm(rounds, desc=f"T={sampling.temperature}", unit="prompt", leave=False)):
        shift = n % len(runners)
        for runner in runners[shift:] + runners[:shift]:
            stats = runner.one(prompts[i], settings.seed + 1000 * r + i)
            runner.total.merge(stats)
            runner.per_prompt.append({"prompt": i, "repeat": r, "new_tokens": stats.new_tokens,
                                      "target_passes": stats.steps, "wall_seconds": stats.wall_seconds,
                                      "tokens_per_s": stats.tokens_per_second, **decode_time(runner.method, stats)})
    return [
        MethodResult(
            runner.method, runner.total, sampling.temperature,
            runner.selector.median_call_us() if runner.selector is not None else None, runner.per_prompt,
        )
        for runner in runners
    ]


def run_bench(methods: list[str], pair, prompts: list[list[int]], settings: BenchSettings,
              temperatures: list[float]) -> list[dict]:
    """Every method at every temperature (one interleaved block per temperature); the rows of all of them."""
    rows = []
    for temperature in temperatures:
        sampling = SamplingConfig(temperature, settings.top_p)
        results = bench_methods(methods, pair, prompts, settings, sampling)
        ar = next((r.stats.tokens_per_second for r in results if r.method == "ar"), None)
        rows.extend(r.row(ar) for r in results)
    return rows


def encode_prompts(pair: LoadedPair, texts: list[str], max_new: int) -> list[list[int]]:
    """Token ids of each prompt, left-truncated so prompt + max_new fits the context window."""
    if pair.tokenizer is None:
        raise ValueError("the pair has no tokenizer; pass --tokenizer DIR")
    room = pair.context_limit - max_new - 1
    if room < 2:
        raise ValueError(f"--max-new-tokens {max_new} leaves no room for a prompt in a {pair.context_limit}-token "
                         "context")
    return [list(pair.tokenizer(t)["input_ids"])[-room:] for t in texts]


def bench_prompts(source: str | None, field_name: str, count: int, skip: int = 0, tokenizer=None,
                  default: str = "builtin:heldout") -> list[str]:
    """``count`` prompt texts after the first ``skip``, from any source `ddte collect` reads (a file,
    ``builtin:train``, ``chat:heldout``, ``hf:NAME``; chat rows rendered with ``tokenizer``'s chat template); by
    default ``default``, the pair's held-out prompts (never seen in training). ValueError when the source has too
    few."""
    from data_gen.prompts import load_prompt_texts

    if skip < 0:
        raise ValueError(f"cannot skip a negative number of prompts ({skip})")
    source = source or default
    texts = load_prompt_texts(source, field=field_name, limit=count + skip, tokenizer=tokenizer)[skip:]
    if not texts:
        raise ValueError(f"{source} has no prompts left after skipping {skip}")
    return texts


def environment(device: torch.device) -> dict:
    import transformers

    return {
        "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
        "machine": platform.machine(), "processor": platform.processor(), "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(), "device": str(device),
        "gpu": torch.cuda.get_device_name(0) if device.type == "cuda" else None,
    }
