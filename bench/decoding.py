"""Decoding methods side by side on the same prompts: the engine of `ddte bench` and of the pipeline's bench stage.

Each method is a :class:`bench.method.Method` (``ar``, ``hf-assisted``, ... or ``VERIFIER@SPEC``, parsed once; static
shapes that draft the same tree are one method, under their canonical shape). Each method first runs
one warm-up prompt; then the methods run interleaved, prompt by prompt in a rotating order, so the CPU's drift
over minutes reaches all of them alike. Every prompt runs ``repeats`` times with fixed seeds
(seed + 1000·repeat + prompt index). Each method is made ready once and runs at every temperature: methods of one
verifier share one decoder, and the sampling settings travel with each generation.
"""

from __future__ import annotations

import contextlib
import itertools
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch
from torch import nn
from tqdm import tqdm

from bench.method import AR, Method
from bench.stock_draft import BaselineDraft, dtype_name, fastest_stock_draft, model_dtype
from ddte_core.machine import environment as machine_environment
from ddte_core.quiet import quiet_transformers
from decode.drafting.rng import TorchRandom
from decode.drafting.sampling import SamplingConfig
from decode.engine import SpeculativeDecoder
from decode.models.kernels import stock_kernels, use_kernel
from decode.pair import LoadedPair
from decode.policies.base import PolicySource
from decode.session import Hooks, LatencyRequest, Session, open_sessions
from decode.stats import GenerationStats


@dataclass
class BenchSettings:
    """What every method shares in one bench run."""

    max_new_tokens: int = 128
    repeats: int = 1
    seed: int = 0
    top_p: float = 1.0
    seconds: float | None = None  # a temperature block's time budget: it stops at the last prompt that fits
    min_prompts: int = 2  # a time budget never stops a block before this many timed prompts (a paired interval)

    def sampling(self, temperature: float) -> SamplingConfig:
        """The sampling settings of one temperature's block (top-p is the run's)."""
        return SamplingConfig(temperature, self.top_p)


@dataclass
class MethodResult:
    """One method's totals and per-prompt figures at one temperature."""

    method: Method
    stats: GenerationStats
    temperature: float = 1.0
    selector_call_us: float | None = None
    per_prompt: list[dict] = field(default_factory=list)
    notes: dict = field(default_factory=dict)  # what the row says of how it ran (an assisted row: its draft's dtype)

    def row(self, ar_tps: float | None) -> dict:
        s = self.stats
        forwards = s.seconds["draft"] + s.seconds["target"] + s.seconds["prefill"]
        rates = [p["tokens_per_s"] for p in self.per_prompt]
        return {
            "method": self.method.key,
            "temperature": self.temperature,
            "tokens_per_s": s.tokens_per_second,
            "tokens_per_s_stdev_over_prompts": statistics.stdev(rates) if len(rates) > 1 else None,
            "speedup": s.tokens_per_second / ar_tps if ar_tps else None,
            "tpot_ms": tpot_ms(self.per_prompt),
            # tokens per target pass, the bonus included: vLLM's name for the paper's block efficiency (Spec-Bench's τ)
            "mean_acceptance_length": s.block_efficiency if s.steps else None,
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
            **self.notes,
            "per_prompt": self.per_prompt,
        }


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
           assistant: nn.Module | None, stock: bool = True) -> tuple[int, float, float]:
    """One HF `generate` call (target alone, or assisted by ``assistant``, a draft module), on the stock models
    (``stock``: every linear layer on ``F.linear``) or on the kernel paths the pair runs; returns (new tokens,
    seconds, seconds to the first new token)."""
    torch.manual_seed(seed)
    clock = FirstTokenClock()
    kwargs = {"max_new_tokens": max_new, "do_sample": not sampling.greedy, "pad_token_id": pair.eos_token_id,
              "streamer": clock}
    if not sampling.greedy:
        kwargs.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=None)
    if assistant is not None:
        kwargs["assistant_model"] = assistant
    models = (pair.target.model,) if assistant is None else (pair.target.model, assistant)
    kernels = tuple(stock_kernels(model) for model in models) if stock else ()
    start = time.perf_counter()
    with contextlib.ExitStack() as stack, torch.inference_mode(), quiet_transformers(bars=True):
        for context in kernels:  # HF assisted generation warns about its own call: quiet
            stack.enter_context(context)
        out = pair.target.model.generate(torch.tensor([ids], device=pair.target.device), **kwargs)
    seconds = time.perf_counter() - start
    return out.shape[1] - len(ids), seconds, (clock.first - start) if clock.first is not None else seconds


@dataclass
class _Runner:
    """One method, ready to run any prompt at any sampling: HF's ``generate`` (no decoder), or a ddte decoder with the
    method's policy (which the decoder starts afresh for every generation)."""

    method: Method
    pair: LoadedPair
    decoder: SpeculativeDecoder | None = None
    policy: PolicySource | None = None
    assistant: nn.Module | None = None  # an HF assisted method's draft module
    notes: dict = field(default_factory=dict)  # what its rows say of how it ran

    def one(self, ids: list[int], seed: int, sampling: SamplingConfig, max_new: int) -> GenerationStats:
        """Generate once after ``ids``; the statistics."""
        if self.decoder is None:
            new, seconds, first = run_hf(self.pair, ids, max_new, sampling, seed, self.assistant,
                                         self.method.on_stock_kernels)
            stats = GenerationStats(new_tokens=new, wall_seconds=seconds)
            stats.seconds["prefill"] += first  # the prompt's pass and the first token
            stats.first_token_seconds = first
            return stats
        return self.decoder.generate(ids, max_new, self.policy, TorchRandom(seed), sampling).stats


def open_bench(pair: LoadedPair, methods: list[Method], kernels: str | None = None,
               latency: str | LatencyRequest | None = None, files: dict | None = None,
               hooks: Hooks | None = None) -> Session:
    """The session of a bench (decode/session.py ``open_sessions``): every ddte method's policy checked against
    ``pair``, the pair on this machine's kernels (``kernels``: as ``--kernels``, None the pair's own), the latency
    table where a method reads one, and each method's policy and decoder; the HF methods need none of it. ``files``:
    the policy files the methods name, read already (by path)."""
    requests = [method.request for method in methods if not method.is_hf]
    return open_sessions(pair, requests, kernels, latency, deployments=files, hooks=hooks)


def make_runners(methods: list[Method], session: Session, llama_cpp=None) -> list:
    """A ready runner per method on ``session``'s pair (:func:`open_bench`), each ddte method on the decoder and
    policy the session opened for it (the methods of one verifier and draft share one decoder); the ``llama-cpp`` row
    on ``llama_cpp``, a started bench/llama_cpp.py server.

    Raises:
        ValueError: a ddte method the session did not open, or a ``llama-cpp`` row without a server.
    """
    pair, runners = session.pair, []
    baseline = _baseline_draft(methods, pair)
    for method in methods:
        if method.kind == "llama-cpp":
            from bench.llama_cpp import LlamaCppRunner

            if llama_cpp is None:
                raise ValueError("the llama-cpp row needs a llama-server: name it with --llama-cpp PATH")
            runners.append(LlamaCppRunner(method, llama_cpp))
            continue
        if method.is_hf:
            runners.append(_hf_runner(method, pair, baseline))
            continue
        decoding = session.decodings.get(method.request)
        if decoding is None:
            raise ValueError(f"method {method} was not opened in this bench's session")
        runners.append(_Runner(method, pair, decoding.decoder, decoding.policy))
    return runners


def _baseline_draft(methods: list[Method], pair: LoadedPair) -> BaselineDraft | None:
    """The draft ``hf-assisted`` runs (bench/stock_draft.py), chosen once and announced on stderr; None without that
    method."""
    if not any(method.hf == "hf-assisted" for method in methods):
        return None
    baseline = fastest_stock_draft(pair.draft.model, pair.draft.device)
    print(baseline.line(), file=sys.stderr)
    return baseline


def _hf_runner(method: Method, pair: LoadedPair, baseline: BaselineDraft | None) -> _Runner:
    """An HF method's runner: ``ar`` and ``ar-kernels`` the target alone; ``hf-assisted`` with ``baseline``'s draft;
    ``hf-assisted-own`` and ``hf-assisted-kernels`` with the pair's own draft module (stock, or on its kernel path)."""
    if method.kind == "hf-assisted":
        return _Runner(method, pair, assistant=baseline.model, notes=baseline.record())
    if not method.kind.startswith("hf-assisted"):
        return _Runner(method, pair)
    if method.kind == "hf-assisted-kernels" and pair.draft.forward_name == "fast":
        use_kernel(pair.draft.model, pair.draft.kernel)  # HF's forward of the draft, on the fast one's path
    draft = pair.draft.model
    return _Runner(method, pair, assistant=draft, notes={"draft_dtype": dtype_name(model_dtype(draft))})


def decode_time(stats: GenerationStats) -> dict[str, float]:
    """The decode phase of one generation: its seconds and tokens after the first one, as vLLM's TPOT counts them,
    for every row alike (ddte's prompt runs inside its first step, an HF row's in its first forward)."""
    return {"decode_seconds": stats.wall_seconds - stats.first_token_seconds,
            "decode_tokens": max(stats.new_tokens - 1, 0)}


def bench_methods(runners: list[_Runner], prompts, settings: BenchSettings, sampling) -> list[MethodResult]:
    """Run every method on every prompt at ``sampling``, interleaved: prompt by prompt, each method in turn.

    A CPU's speed drifts by 10–20 % over minutes (thermal, other tenants). Running one method's prompts after
    another's would fold that drift into the comparison; interleaving spreads it over all methods alike, and the
    order of the methods rotates from one prompt to the next so no method always runs right after the same one.
    A first round runs the first prompt as a warm-up (first-call costs, the latency table), not counted.

    ``settings.seconds``: the block ends after the last round whose end, at the mean pace of the timed rounds so
    far, fits in that budget (never before ``settings.min_prompts`` timed rounds); the progress bar's total and ETA
    follow that estimate. Every method runs the same rounds, so the rows stay paired.
    """
    results = [MethodResult(runner.method, GenerationStats(), sampling.temperature, notes=runner.notes)
               for runner in runners]
    pairs = list(zip(runners, results, strict=True))
    timed = enumerate(itertools.product(range(len(prompts)), range(settings.repeats)))  # prompt, then repeat
    rounds = [(0, 0, 0, False)] + [(i, r, n % len(pairs), True) for n, (i, r) in timed]  # warm-up, then timed
    bar = tqdm(total=len(rounds), desc=f"T={sampling.temperature}", unit="prompt", leave=False)
    started = timed_from = time.perf_counter()
    done = 0
    for i, r, shift, counted in rounds:
        if counted and settings.seconds is not None and done >= settings.min_prompts:
            pace = (time.perf_counter() - timed_from) / done
            if time.perf_counter() - started + pace > settings.seconds:
                break
        for runner, result in pairs[shift:] + pairs[:shift]:
            stats = runner.one(prompts[i], settings.seed + 1000 * r + i, sampling, settings.max_new_tokens)
            if not counted:
                continue
            result.stats.merge(stats)
            result.per_prompt.append({"prompt": i, "repeat": r, "new_tokens": stats.new_tokens,
                                      "target_passes": stats.steps, "wall_seconds": stats.wall_seconds,
                                      "tokens_per_s": stats.tokens_per_second, **decode_time(stats)})
        done += counted
        if not counted:
            timed_from = time.perf_counter()
        elif settings.seconds is not None:  # the rounds that fit at this pace, for the bar's total and ETA
            pace = (time.perf_counter() - timed_from) / done
            fits = done + int(max(settings.seconds - (time.perf_counter() - started), 0.0) // pace)
            bar.total = 1 + min(len(rounds) - 1, max(fits, settings.min_prompts))
        bar.update()
    bar.close()
    for result in results:
        calls = result.stats.network_seconds
        result.selector_call_us = 1e6 * statistics.median(calls) if calls else None
    return results


def run_bench(methods: list[Method], session: Session, prompts: list[list[int]], settings: BenchSettings,
              temperatures: list[float], llama_cpp=None) -> list[dict]:
    """Every method at every temperature (one interleaved block per temperature) on what ``session`` opened
    (:func:`open_bench`); the rows of all of them (``llama_cpp``: the server of a ``llama-cpp`` row)."""
    runners = make_runners(methods, session, llama_cpp)
    rows = []
    for temperature in temperatures:
        sampling = settings.sampling(temperature)
        results = bench_methods(runners, prompts, settings, sampling)
        ar = next((r.stats.tokens_per_second for r in results if r.method == AR), None)
        rows.extend(r.row(ar) for r in results)
    return rows


def encode_prompts(pair: LoadedPair, texts: list[str], max_new: int,
                   truncated: list[int] | None = None) -> list[list[int]]:
    """Token ids of each prompt, left-truncated so prompt + max_new fits the context window; the indices of the
    prompts cut are appended to ``truncated`` when given (the caller says so). ValueError for an empty prompt."""
    if pair.tokenizer is None:
        raise ValueError("the pair has no tokenizer; pass --tokenizer DIR")
    room = pair.context_limit - max_new - 1
    if room < 2:
        raise ValueError(f"--max-new-tokens {max_new} leaves no room for a prompt in a {pair.context_limit}-token "
                         "context")
    out = []
    for index, text in enumerate(texts):
        if not text:
            raise ValueError(f"prompt {index + 1} is empty (it would generate from nothing but the start token)")
        ids = list(pair.tokenizer(text)["input_ids"])
        if len(ids) > room and truncated is not None:
            truncated.append(index)
        out.append(ids[-room:])
    return out


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


def bench_prompt_categories(source: str | None, count: int, skip: int = 0,
                            default: str = "builtin:heldout") -> list[str] | None:
    """Each bench prompt's category (as :func:`bench_prompts` picks them): from a chat or mixed prompt set, or from a
    JSONL file whose every row has a ``category`` (as `ddte build-prompts --chat` writes); None otherwise."""
    from data_gen.chat_prompts import build_chat_prompts, split_source
    from data_gen.prompts import load_prompts

    parsed = split_source(source or default)
    if parsed is None:
        if not str(source).endswith(".jsonl"):
            return None
        try:
            categories = load_prompts(source, field="category", limit=count + skip)[skip:]
        except ValueError:  # a row without a category: the file has none to report
            return None
        return categories
    workload, chat_set = parsed
    return [r["category"] for r in build_chat_prompts(chat_set, count=count + skip, workload=workload)[skip:]]


def tpot_ms(prompts: list[dict]) -> float | None:
    """TPOT (ms per new token, prefill excluded: :func:`decode_time`) over per-prompt records; None without
    decode tokens."""
    tokens = sum(p.get("decode_tokens", 0) for p in prompts)
    return 1000 * sum(p.get("decode_seconds", 0.0) for p in prompts) / tokens if tokens else None


def category_rows(rows: list[dict], categories: list[str]) -> list[dict]:
    """Per prompt category, each row's tokens/s, TPOT and mean acceptance length over its prompts in that category
    (``categories[i]`` is prompt i's), with the speedup against AR in the same category and temperature."""
    out = []
    for category in sorted(set(categories)):
        ar = {}
        for row in rows:
            prompts = [p for p in row["per_prompt"] if categories[p["prompt"]] == category]
            if not prompts:
                continue
            tokens = sum(p["new_tokens"] for p in prompts)
            seconds = sum(p["wall_seconds"] for p in prompts)
            passes = sum(p["target_passes"] for p in prompts)
            entry = {"category": category, "method": row["method"], "temperature": row["temperature"],
                     "prompts": len(prompts), "tokens_per_s": tokens / seconds if seconds else 0.0,
                     "tpot_ms": tpot_ms(prompts),
                     "mean_acceptance_length": tokens / passes if passes else None}
            if row["method"] == AR.key:
                ar[row["temperature"]] = entry["tokens_per_s"]
            out.append(entry)
        for entry in out:
            if entry["category"] == category:
                base = ar.get(entry["temperature"])
                entry["speedup"] = entry["tokens_per_s"] / base if base else None
    return out


def environment(device: torch.device) -> dict:
    """The machine record (:func:`ddte_core.machine.environment`) with the device the bench ran on and its GPU."""
    return machine_environment() | {"device": str(device),
                                    "gpu": torch.cuda.get_device_name(0) if device.type == "cuda" else None}
