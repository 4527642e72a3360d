"""Generate text with lossless speculative decoding over delayed draft trees.

The prompt is text (encoded with the pair's tokenizer) or --prompt-ids (works without a tokenizer). Every
sample is exactly distributed as the target model's own sampling at this temperature and top-p. The draft
only makes it faster. The tree shape comes from --policy (static --action, adaptive, entropy), a trained
--selector, a fitted --expander (it halts the trunk node by node while drafting), or the --policy-file that
`ddte pipeline` writes (its choice per verifier and temperature).

Examples:
  ddte generate "def fibonacci(n):" --verifier traversal --action 2,2,4 --max-new-tokens 64
  ddte generate --prompt-ids 1,400,12 --policy adaptive --temperature 0 --num-samples 3 --output out.jsonl
  ddte generate "def f(x):" --policy-file runs/pipeline/policy.json --temperature 0.6
  ddte generate --pair smollm2 "Write a haiku about rain." --action 2,1,3 --verifier specinfer --temperature 0.6
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from ddte.commands.common import (
    MAX_SEED,
    UserError,
    add_latency_argument,
    add_pair_arguments,
    add_threads_argument,
    apply_threads,
    check_latency_argument,
    check_output_file,
    load_pair_from_args,
    policy_latency,
    seed_argument,
    use_machine_kernels,
    user_errors,
)
from decode.policies.base import POLICIES
from decode.verifiers import VERIFIERS, verifier_names

DEFAULT_ACTION = "2,2,4"
DEFAULT_VERIFIER = "traversal"


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
    parser.add_argument("--expander", default=None, metavar="FILE.onnx",
                        help="a fitted expander (ddte expander) halts the trunk node by node while drafting (instead "
                        "of --policy)")
    parser.add_argument("--policy-file", default=None, metavar="policy.json",
                        help="the deployment choice `ddte pipeline` wrote (sets --verifier unless given, and the "
                        "policy for this temperature)")
    add_latency_argument(parser)
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
    parser.add_argument("--num-samples", type=int, default=1, help="samples of the same prompt")
    parser.add_argument("--seed", type=seed_argument, default=0, help="sample i uses seed + i")
    add_threads_argument(parser)
    parser.add_argument("--output", default=None, help="write one JSON line per sample (tokens, text, stats)")


def check_arguments(args: argparse.Namespace) -> list[int] | None:
    """Every option checked with its flag's name, before any model is loaded; the --prompt-ids, read (None when the
    prompt is text)."""
    if args.verifier is not None and args.verifier not in VERIFIERS:
        raise UserError(f"--verifier: unknown verifier '{args.verifier}'; known: {', '.join(verifier_names())}")
    if args.policy not in POLICIES:
        raise UserError(f"--policy: unknown policy '{args.policy}'; known: {', '.join(POLICIES.names())}")
    if args.policy_file and (args.selector or args.policy != "static" or args.action):
        raise UserError("--policy-file chooses the policy: do not combine it with --policy, --action or --selector")
    if args.selector and (args.policy != "static" or args.action):
        raise UserError("--selector chooses the tree: do not combine it with --policy or --action")
    if args.expander and (args.selector or args.policy_file or args.policy != "static" or args.action):
        raise UserError("--expander chooses the tree: do not combine it with --policy, --action, --selector or "
                        "--policy-file")
    if args.action is not None and args.policy != "static":
        raise UserError(f"--action is the static policy's shape; --policy {args.policy} does not use it")
    if args.max_draft < 1:
        raise UserError(f"--max-draft must be >= 1, got {args.max_draft}")
    check_latency_argument(args.latency)
    if args.latency != "machine" and not (args.selector or args.expander or args.policy_file):
        raise UserError("--latency is the step-time model of a --selector, --expander or --policy-file: give one "
                        "of them, or leave --latency out")
    if not 0 < args.entropy_threshold < math.inf:
        raise UserError(f"--entropy-threshold must be a finite number > 0, got {args.entropy_threshold}")
    if not 0 <= args.temperature < math.inf:
        raise UserError(f"--temperature must be a finite number >= 0, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise UserError(f"--top-p must be in (0, 1], got {args.top_p}")
    if not 0 <= args.seed or args.seed + args.num_samples - 1 > MAX_SEED:
        raise UserError(f"--seed must be in [0, {MAX_SEED}] (with --num-samples: seed + samples - 1 too), got "
                        f"{args.seed}")
    if args.max_new_tokens < 1 or args.num_samples < 1:
        raise UserError("--max-new-tokens and --num-samples must be >= 1")
    if (args.prompt is None) == (args.prompt_ids is None):
        raise UserError("give exactly one of a prompt text or --prompt-ids")
    if args.prompt_ids is None:
        try:
            args.prompt.encode("utf-8")
        except UnicodeEncodeError as err:  # the shell passed bytes that are not UTF-8 (kept as surrogates)
            raise UserError(f"the prompt is not UTF-8 text (undecodable byte at character {err.start})") from err
        if not args.prompt:
            raise UserError("the prompt is empty: give some text, or --prompt-ids")
        return None
    try:
        ids = [int(x) for x in args.prompt_ids.split(",")]
    except ValueError as err:
        raise UserError(f"--prompt-ids must be comma-separated integers (no empty items), got "
                        f"'{args.prompt_ids}'") from err
    if not ids:
        raise UserError("--prompt-ids is empty")
    return ids


def run(args: argparse.Namespace) -> int:
    """One way down: the flags are checked and the output's folder made, the pair loads, the policy file is read
    once and the policy built, then every sample runs at this call's sampling settings and the output is written
    whole."""
    from ddte_core.paths import staged_file
    from decode.drafting.rng import TorchRandom
    from decode.drafting.sampling import SamplingConfig
    from decode.engine import SpeculativeDecoder
    from decode.stats import GenerationStats

    ids = check_arguments(args)
    apply_threads(args.threads)
    output = check_output_file(args.output) if args.output else None
    pair = load_pair_from_args(args)
    sampling = SamplingConfig(args.temperature, args.top_p)
    verifier, policy, rebuild = _policy(args, pair)
    ids = _prompt_ids(args, pair) if ids is None else ids
    print(use_machine_kernels(pair, args), file=sys.stderr)  # every check passed: the work starts here
    machine = None
    if rebuild is not None:
        machine, which = policy_latency(args.latency, pair, announce=lambda line: print(line, file=sys.stderr))
        print(which, file=sys.stderr)
        if machine is not None:
            policy = rebuild(machine)
    note = policy.sampling_note(sampling)
    if note:
        print(note, file=sys.stderr)
    with user_errors():
        decoder = SpeculativeDecoder(pair.target, pair.draft, verifier, pair.eos_token_id, latency=machine)
    total = GenerationStats()
    lines = []
    for i in range(args.num_samples):
        with user_errors():
            gen = decoder.generate(ids, args.max_new_tokens, policy, TorchRandom(args.seed + i), sampling)
        total.merge(gen.stats)
        record = {"sample": i, **gen.as_dict(pair.tokenizer)}
        lines.append(json.dumps(record) + "\n")
        print(f"--- sample {i} ({len(gen.tokens)} tokens, stopped by {gen.stopped_by})")
        print(record.get("text", ",".join(str(t) for t in gen.tokens)))
    stream = sys.stderr if output is None else sys.stdout
    print(f"verifier {verifier.name}, policy {policy.describe(sampling)}, T={args.temperature}, top-p={args.top_p}: "
          f"{total.summary()}", file=stream)
    print(total.vs_plain_decoding(), file=stream)
    if output is not None:
        try:
            with staged_file(output) as tmp:
                tmp.write_text("".join(lines))
        except OSError as err:
            raise UserError(f"cannot write {output}: {err.strerror}") from err
    return 0


def _policy(args: argparse.Namespace, pair):
    """(the verifier, the policy, and for a policy file a function that builds it again on the machine's latency
    table, else None): every file is read once and checked against the pair before a table is measured."""
    from decode.drafting.actions import Action, check_in_grid
    from decode.engine import check_action
    from decode.policies.base import PolicyOptions, make_policy
    from decode.policies.deployment import load_deployment, load_policy
    from decode.verifiers import get_verifier

    with user_errors(prefix="--policy-file: "):
        deployment = load_deployment(args.policy_file) if args.policy_file else None
        verifier = get_verifier(args.verifier or (deployment.verifier if deployment else DEFAULT_VERIFIER))
    kind, path = next(((kind, path) for kind, path in (("policy", args.policy_file), ("selector", args.selector),
                                                       ("expander", args.expander)) if path), (None, None))
    if kind is not None:
        read = {str(path): deployment} if deployment else {}
        with user_errors(prefix="--policy-file: " if kind == "policy" else ""):
            policy = load_policy(kind, path, verifier.name, pair, None, read)
        return verifier, policy, lambda machine: load_policy(kind, path, verifier.name, pair, machine, read)
    with user_errors(prefix="--action: "):
        action = Action.parse(args.action or DEFAULT_ACTION)
        check_in_grid(action)
        if args.policy == "static":
            check_action(verifier, action)
    with user_errors():
        return verifier, make_policy(args.policy, PolicyOptions(action, args.max_draft, args.entropy_threshold)), None


def _prompt_ids(args: argparse.Namespace, pair) -> list[int]:
    """The prompt's token ids: the text, rendered with the pair's chat template where asked (or the pair is a chat
    pair and --chat is auto)."""
    from decode.pair import render_chat

    if pair.tokenizer is None:
        raise UserError("no tokenizer found for the pair: pass --tokenizer DIR or use --prompt-ids")
    text = args.prompt
    if args.chat == "on" or (args.chat == "auto" and pair.chat):
        with user_errors(prefix="--chat: "):
            text = render_chat(pair.tokenizer, [{"role": "user", "content": args.prompt}])
    ids = list(pair.tokenizer(text)["input_ids"])
    if not ids:
        raise UserError("the prompt encodes to no tokens")
    return ids
