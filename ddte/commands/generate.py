"""Generate text with lossless speculative decoding over delayed draft trees.

The prompt is text (encoded with the pair's tokenizer) or --prompt-ids (works without a tokenizer). Every
sample is exactly distributed as the target model's own sampling at this temperature and top-p. The draft
only makes it faster. The tree shape comes from --policy (static --action, adaptive, entropy), a trained
--selector, or the --policy-file that `ddte pipeline` writes (its choice per verifier and temperature).

Examples:
  ddte generate "def fibonacci(n):" --verifier traversal --action 2,2,4 --max-new-tokens 64
  ddte generate --prompt-ids 1,400,12 --policy adaptive --temperature 0 --num-samples 3 --output out.jsonl
  ddte generate "def f(x):" --policy-file runs/pipeline/policy.json --temperature 0.6
  ddte generate --pair smollm2 "Write a haiku about rain." --action 2,1,3 --verifier specinfer --temperature 0.6
"""

from __future__ import annotations

import argparse
import json
import sys

from ddte.commands.common import (
    UserError,
    add_pair_arguments,
    add_threads_argument,
    apply_threads,
    check_output_file,
    deprecated,
    load_pair_from_args,
    user_errors,
)
from decode.policies import POLICIES
from decode.verifiers import VERIFIERS, verifier_names

DEFAULT_ACTION = "2,2,4"


def add_decoding_arguments(parser: argparse.ArgumentParser) -> None:
    """The sampling and policy options shared by generate-like commands."""
    parser.add_argument("--verifier", default=None,
                        help=f"the lossless verifier: {', '.join(verifier_names())} (default: traversal, or the "
                        "--policy-file's)")
    parser.add_argument("--policy", default="static",
                        help=f"{', '.join(POLICIES.names())}: static drafts --action every step; adaptive is HF's "
                        "+2/-1 schedule; entropy stops a single path where the draft is unsure")
    parser.add_argument("--action", default=None, metavar="K,L1,L2",
                        help=f"the static policy's tree shape (default {DEFAULT_ACTION})")
    parser.add_argument("--entropy-threshold", type=float, default=2.0, help="entropy policy: stop above (nats)")
    parser.add_argument("--max-draft", type=int, default=8, help="adaptive/entropy policies: longest draft")
    parser.add_argument("--selector", default=None, metavar="FILE.onnx",
                        help="a trained selector (ddte export) picks the tree at every step (instead of --policy)")
    parser.add_argument("--policy-file", default=None, metavar="policy.json",
                        help="the deployment choice `ddte pipeline` wrote (sets --verifier unless given, and the "
                        "policy for this temperature)")
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus threshold in (0, 1]")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", nargs="?", default=None, help="prompt text (needs the pair's tokenizer)")
    parser.add_argument("--prompt-ids", default=None, help="comma-separated token ids instead of text")
    parser.add_argument("--chat", default="auto", choices=("auto", "on", "off"),
                        help="send the prompt as a user message through the tokenizer's chat template (auto: when "
                        "the pair's prompts are chat prompts, as for smollm2)")
    add_pair_arguments(parser)
    add_decoding_arguments(parser)
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per sample")
    deprecated(parser, "--new-tokens", "--max-new-tokens", "max_new_tokens", type=int)
    parser.add_argument("--num-samples", type=int, default=1, help="samples of the same prompt")
    parser.add_argument("--seed", type=int, default=0, help="sample i uses seed + i")
    add_threads_argument(parser)
    parser.add_argument("--output", default=None, help="write one JSON line per sample (tokens, text, stats)")


def check_decoding_arguments(args: argparse.Namespace) -> None:
    """Every decoding option checked with its flag's name, before any model is loaded."""
    if args.verifier is not None and args.verifier not in VERIFIERS:
        raise UserError(f"--verifier: unknown verifier '{args.verifier}'; known: {', '.join(verifier_names())}")
    if args.policy not in POLICIES:
        raise UserError(f"--policy: unknown policy '{args.policy}'; known: {', '.join(POLICIES.names())}")
    if args.policy_file and (args.selector or args.policy != "static" or args.action):
        raise UserError("--policy-file chooses the policy: do not combine it with --policy, --action or --selector")
    if args.selector and (args.policy != "static" or args.action):
        raise UserError("--selector chooses the tree: do not combine it with --policy or --action")
    if args.action is not None and args.policy != "static":
        raise UserError(f"--action is the static policy's shape; --policy {args.policy} does not use it")
    if args.max_draft < 1:
        raise UserError(f"--max-draft must be >= 1, got {args.max_draft}")
    if args.entropy_threshold <= 0:
        raise UserError(f"--entropy-threshold must be > 0, got {args.entropy_threshold}")
    if not args.temperature >= 0:
        raise UserError(f"--temperature must be >= 0, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise UserError(f"--top-p must be in (0, 1], got {args.top_p}")


def policy_factory(args: argparse.Namespace, pair, verifier, sampling):
    """A function giving the policy of one generation: fresh for a stateful policy, shared otherwise.

    The policy comes from --policy-file, --selector or --policy; a file that does not match this pair, verifier or
    feature schema is refused.
    """
    from decode.actions import Action
    from decode.engine import check_action
    from decode.policies import PolicyOptions, make_policy
    from decode.selector_policy import OnnxSelectorPolicy

    if args.policy_file:
        from decode.deployment import load_deployment

        with user_errors(prefix="--policy-file: "):
            policy = load_deployment(args.policy_file).policy_for(verifier.name, sampling, pair)
        return lambda: policy
    if args.selector:
        with user_errors():
            selector = OnnxSelectorPolicy.for_pair(args.selector, verifier.name, pair, sampling)
        return lambda: selector  # stateless between generations: one onnxruntime session serves every sample
    with user_errors(prefix="--action: "):
        action = Action.parse(args.action or DEFAULT_ACTION)
        if args.policy == "static":
            check_action(verifier, action)
    options = PolicyOptions(action, args.max_draft, args.entropy_threshold)
    with user_errors():
        policy = make_policy(args.policy, options)
    return (lambda: make_policy(args.policy, options)) if policy.stateful else (lambda: policy)


def resolve_verifier(args: argparse.Namespace) -> None:
    """--verifier, else the --policy-file's verifier, else traversal."""
    if args.verifier is None and args.policy_file:
        from decode.deployment import load_deployment

        with user_errors(prefix="--policy-file: "):
            args.verifier = load_deployment(args.policy_file).verifier
    args.verifier = args.verifier or "traversal"


def build_decoder(args: argparse.Namespace):
    """Validate the options, load the pair, build (pair, decoder, policy factory); UserError on bad input."""
    from decode.engine import SpeculativeDecoder
    from decode.sampling import SamplingConfig
    from decode.verifiers import get_verifier

    check_decoding_arguments(args)
    resolve_verifier(args)
    sampling = SamplingConfig(args.temperature, args.top_p)
    verifier = get_verifier(args.verifier)
    pair = load_pair_from_args(args)
    with user_errors():
        decoder = SpeculativeDecoder(pair.target, pair.draft, verifier, sampling, pair.eos_token_id)
    return pair, decoder, policy_factory(args, pair, verifier, sampling)


def prompt_ids(args: argparse.Namespace, tokenizer, chat_pair: bool = False) -> list[int]:
    """The prompt's token ids: --prompt-ids as given, or the text, through the chat template when --chat says so
    (``chat_pair``: the pair's prompts are chat prompts)."""
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
    text = args.prompt
    if args.chat == "on" or (args.chat == "auto" and chat_pair):
        from data_gen.chat_prompts import render_chat

        with user_errors(prefix="--chat: "):
            text = render_chat(tokenizer, [{"role": "user", "content": args.prompt}])
    ids = tokenizer(text)["input_ids"]
    if not ids:
        raise UserError("the prompt encodes to no tokens")
    return list(ids)


def run(args: argparse.Namespace) -> int:
    from decode.rng import TorchRandom
    from decode.stats import GenerationStats

    if args.max_new_tokens < 1 or args.num_samples < 1:
        raise UserError("--max-new-tokens and --num-samples must be >= 1")
    output = check_output_file(args.output) if args.output else None
    apply_threads(args.threads)
    pair, decoder, make_policy = build_decoder(args)
    ids = prompt_ids(args, pair.tokenizer, pair.chat)
    total = GenerationStats()
    records = []
    policy_name = "?"
    for i in range(args.num_samples):
        policy = make_policy()
        policy_name = _describe(policy)
        with user_errors():
            gen = decoder.generate(ids, args.max_new_tokens, policy, TorchRandom(args.seed + i))
        total.merge(gen.stats)
        records.append(_record(i, gen, pair.tokenizer))
        _print_sample(records[-1])
    print(_summary(total, args, policy_name), file=sys.stderr if output is None else sys.stdout)
    if output is not None:
        _write_jsonl(output, records)
    return 0


def _describe(policy) -> str:
    if policy.name == "static":
        return f"static {policy.action}"
    if policy.name == "selector":
        return f"selector {policy.path} (fallback {policy.fallback}, margin {policy.margin})"
    return policy.name


def _record(index: int, gen, tokenizer) -> dict:
    record = {"sample": index, "tokens": gen.tokens, "stopped_by": gen.stopped_by, "stats": gen.stats.as_dict()}
    if tokenizer is not None:
        record["text"] = tokenizer.decode(gen.tokens)
    return record


def _print_sample(record: dict) -> None:
    body = record.get("text", ",".join(str(t) for t in record["tokens"]))
    print(f"--- sample {record['sample']} ({len(record['tokens'])} tokens, stopped by {record['stopped_by']})")
    print(body)


def _summary(stats, args: argparse.Namespace, policy: str) -> str:
    split = ", ".join(f"{k} {v / max(stats.wall_seconds, 1e-12):.0%}" for k, v in stats.seconds.items())
    return (
        f"verifier {args.verifier}, policy {policy}, T={args.temperature}, top-p={args.top_p}: "
        f"{stats.new_tokens} tokens in {stats.steps} target passes, block efficiency {stats.block_efficiency:.2f}, "
        f"acceptance rate {stats.acceptance_rate:.2f}, {stats.tokens_per_second:.1f} tokens/s (time: {split})"
    )


def _write_jsonl(path, records: list[dict]) -> None:
    import os

    tmp = f"{path}.tmp"
    try:
        with open(tmp, "w") as f:
            for record in records:
                f.write(json.dumps(record) + "\n")
        os.replace(tmp, path)
    except OSError as err:
        raise UserError(f"cannot write {path}: {err.strerror}") from err
