"""Generate text with lossless speculative decoding over delayed draft trees.

The prompt is text (encoded with the pair's tokenizer) or --prompt-ids (works without a tokenizer). Every
sample is exactly distributed as the target model's own sampling at this temperature and top-p. The draft
only makes it faster.

Examples:
  ddte generate "def fibonacci(n):" --verifier traversal --action 2,2,4 --max-new-tokens 64
  ddte generate --prompt-ids 1,400,12 --policy adaptive --temperature 0 --num-samples 3 --output out.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from ddte.cli import UserError
from decode.drafting import Action
from decode.engine import Generation, SpeculativeDecoder, check_action
from decode.pair import DEFAULT_DRAFT, DEFAULT_TARGET, load_pair, read_pair_config
from decode.policies import AdaptiveLengthPolicy, EntropyStopPolicy, Policy, StaticPolicy
from decode.rng import TorchRandom
from decode.sampling import SamplingConfig
from decode.stats import GenerationStats
from decode.verifiers import get_verifier, verifier_names

POLICIES = ("static", "adaptive", "entropy")


def add_pair_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--pair", default=None, help="pair YAML with keys target, draft, tokenizer (overrides --target/--draft)"
    )
    parser.add_argument("--target", default=str(DEFAULT_TARGET), help="target model directory (default: shipped)")
    parser.add_argument("--draft", default=str(DEFAULT_DRAFT), help="draft model directory (default: shipped)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory (default: found beside the target)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or auto (default: cpu)")


def add_decoding_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--verifier", default="traversal", help=f"one of: {', '.join(verifier_names())}")
    parser.add_argument("--action", default="2,2,4", help="static tree shape K,L1,L2 (default 2,2,4)")
    parser.add_argument(
        "--policy", default="static", choices=POLICIES,
        help="static uses --action; adaptive is HF's +2/-1 schedule; "
        "entropy stops a single path where the draft is unsure",
    )
    parser.add_argument("--entropy-threshold", type=float, default=2.0, help="entropy policy: stop above (nats)")
    parser.add_argument(
        "--selector", default=None, metavar="FILE.onnx",
        help="a trained selector (ddte export) picks the tree at every step; overrides --policy",
    )
    parser.add_argument("--max-draft", type=int, default=8, help="adaptive/entropy policies: longest draft")
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default 1.0)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus threshold in (0, 1] (default 1)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", nargs="?", default=None, help="prompt text (needs the pair's tokenizer)")
    parser.add_argument("--prompt-ids", default=None, help="comma-separated token ids instead of text")
    add_pair_arguments(parser)
    add_decoding_arguments(parser)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--num-samples", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0, help="sample i uses seed + i")
    parser.add_argument("--output", default=None, help="write one JSON line per sample (tokens, text, stats)")


def build_decoder(args: argparse.Namespace):
    """Validate the decoding options, load the pair and build (pair, decoder, policy factory)."""
    try:
        sampling = SamplingConfig(args.temperature, args.top_p)
    except ValueError as err:
        raise UserError(str(err)) from err
    try:
        verifier = get_verifier(args.verifier)
    except KeyError as err:
        raise UserError(err.args[0]) from err
    try:
        action = Action.parse(args.action)
        if args.policy == "static":
            check_action(verifier, action)
    except ValueError as err:
        raise UserError(str(err)) from err
    try:
        pair = load_pair_from_args(args)
        decoder = SpeculativeDecoder(pair.target, pair.draft, verifier, sampling, pair.eos_token_id)
    except ValueError as err:
        raise UserError(str(err)) from err

    if getattr(args, "selector", None):
        selector = make_selector_policy(args.selector, verifier.name, pair, args)

        def make_policy() -> Policy:
            return selector  # stateless between steps: one onnxruntime session serves every sample

        return pair, decoder, make_policy

    def make_policy() -> Policy:
        return make_named_policy(args.policy, action, args.max_draft, args.entropy_threshold)

    try:
        make_policy()
    except ValueError as err:
        raise UserError(str(err)) from err

    return pair, decoder, make_policy


def pair_paths_from_args(args: argparse.Namespace) -> dict[str, str | None]:
    """target/draft/tokenizer directories named by --pair or --target/--draft/--tokenizer."""
    if args.pair:
        paths = read_pair_config(args.pair)
        tokenizer = args.tokenizer or paths.get("tokenizer")
        return {"target": paths["target"], "draft": paths["draft"], "tokenizer": tokenizer}
    return {"target": args.target, "draft": args.draft, "tokenizer": args.tokenizer}


def make_selector_policy(path: str, verifier: str, pair, args: argparse.Namespace):
    """An OnnxSelectorPolicy checked against this pair (hidden sizes, fingerprint) and verifier; UserError if not."""
    from decode.pair import pair_fingerprint
    from decode.selector_policy import OnnxSelectorPolicy, SelectorError

    paths = pair_paths_from_args(args)
    try:
        return OnnxSelectorPolicy(
            path, verifier=verifier,
            target_hidden=int(pair.target.config.hidden_size), draft_hidden=int(pair.draft.config.hidden_size),
            pair_fingerprint=pair_fingerprint(paths["target"], paths["draft"], paths["tokenizer"]),
            use_cuda=pair.target.device.type == "cuda",
        )
    except SelectorError as err:
        raise UserError(str(err)) from err


def load_pair_from_args(args: argparse.Namespace):
    """The pair named by --pair, or by --target/--draft/--tokenizer."""
    if args.pair:
        paths = read_pair_config(args.pair)
        return load_pair(paths["target"], paths["draft"], args.tokenizer or paths.get("tokenizer"), args.device)
    return load_pair(args.target, args.draft, args.tokenizer, args.device)


def make_named_policy(name: str, action: Action, max_draft: int = 8, entropy_threshold: float = 2.0) -> Policy:
    """A fresh policy by name: static (the action), adaptive or entropy."""
    if name == "static":
        return StaticPolicy(action)
    if name == "adaptive":
        return AdaptiveLengthPolicy(initial=min(4, max_draft), maximum=max_draft)
    if name == "entropy":
        return EntropyStopPolicy(max_length=max_draft, threshold=entropy_threshold)
    raise ValueError(f"unknown policy '{name}' ({', '.join(POLICIES)})")


def prompt_ids(args: argparse.Namespace, tokenizer) -> list[int]:
    if (args.prompt is None) == (args.prompt_ids is None):
        raise UserError("give exactly one of a prompt text or --prompt-ids")
    if args.prompt_ids is not None:
        try:
            ids = [int(x) for x in args.prompt_ids.split(",") if x.strip()]
        except ValueError as err:
            raise UserError(f"--prompt-ids must be comma-separated integers, got '{args.prompt_ids}'") from err
        if not ids:
            raise UserError("--prompt-ids is empty")
        return ids
    if tokenizer is None:
        raise UserError("no tokenizer found for the pair: pass --tokenizer DIR or use --prompt-ids")
    ids = tokenizer(args.prompt)["input_ids"]
    if not ids:
        raise UserError("the prompt encodes to no tokens")
    return list(ids)


def run(args: argparse.Namespace) -> int:
    if args.max_new_tokens < 1 or args.num_samples < 1:
        raise UserError("--max-new-tokens and --num-samples must be >= 1")
    pair, decoder, make_policy = build_decoder(args)
    ids = prompt_ids(args, pair.tokenizer)
    total = GenerationStats()
    records = []
    for i in range(args.num_samples):
        try:
            gen = decoder.generate(ids, args.max_new_tokens, make_policy(), TorchRandom(args.seed + i))
        except ValueError as err:
            raise UserError(str(err)) from err
        total.merge(gen.stats)
        records.append(_record(i, gen, pair.tokenizer))
        _print_sample(records[-1])
    print(_summary(total, args), file=sys.stderr if args.output is None else sys.stdout)
    if args.output:
        _write_jsonl(args.output, records)
    return 0


def _record(index: int, gen: Generation, tokenizer) -> dict:
    record = {"sample": index, "tokens": gen.tokens, "stopped_by": gen.stopped_by, "stats": gen.stats.as_dict()}
    if tokenizer is not None:
        record["text"] = tokenizer.decode(gen.tokens)
    return record


def _print_sample(record: dict) -> None:
    body = record.get("text", ",".join(str(t) for t in record["tokens"]))
    print(f"--- sample {record['sample']} ({len(record['tokens'])} tokens, stopped by {record['stopped_by']})")
    print(body)


def _summary(stats: GenerationStats, args: argparse.Namespace) -> str:
    split = ", ".join(f"{k} {v / max(stats.wall_seconds, 1e-12):.0%}" for k, v in stats.seconds.items())
    return (
        f"verifier {args.verifier}, policy "
        + (f"selector {args.selector}" if args.selector else args.policy)
        + (f" {args.action}" if args.policy == "static" and not args.selector else "")
        + f", T={args.temperature}, top-p={args.top_p}: {stats.new_tokens} tokens in {stats.steps} target passes, "
        f"block efficiency {stats.block_efficiency:.2f}, acceptance rate {stats.acceptance_rate:.2f}, "
        f"{stats.tokens_per_second:.1f} tokens/s (time: {split})"
    )


def _write_jsonl(path: str, records: list[dict]) -> None:
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "w") as f:
            for record in records:
                f.write(json.dumps(record) + "\n")
        os.replace(tmp, path)
    except OSError as err:
        raise UserError(f"cannot write {path}: {err.strerror}") from err
