"""Generate text with lossless speculative decoding over delayed draft trees.

The prompt is text (encoded with the pair's tokenizer) or --prompt-ids (works without a tokenizer). Every
sample is exactly distributed as the target model's own sampling at this temperature and top-p. The draft
only makes it faster. The tree shape comes from --policy (static --action, adaptive, entropy), a trained
--selector, a fitted --expander (it halts the trunk node by node while drafting), or the --policy-file that
`ddte pipeline` writes (its choice per verifier and temperature). --method VERIFIER@SPEC names the verifier and the
policy in one, as `ddte bench` and `ddte serve` take them; the flags are another spelling of the same method.

Examples:
  ddte generate "def fibonacci(n):" --verifier traversal --action 2,2,4 --max-new-tokens 64
  ddte generate --prompt-ids 1,400,12 --policy adaptive --temperature 0 --num-samples 3 --output out.jsonl
  ddte generate "def f(x):" --policy-file runs/pipeline/policy.json --temperature 0.6
  ddte generate --pair smollm2 "Write a haiku about rain." --action 2,1,3 --verifier specinfer --temperature 0.6
  ddte generate "def f(x):" --method specinfer@entropy:threshold=1.5 --temperature 0.6
"""

from __future__ import annotations

import argparse
import json
import math
import re
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
    seed_argument,
    shell_hooks,
    user_errors,
)
from decode.policies.kinds import DEFAULT_ENTROPY_THRESHOLD, DEFAULT_MAX_DRAFT, SPEC_FORMS, kind_names
from decode.policies.spec import PolicySpec, check_entropy_threshold, check_max_draft, parse_policy_spec
from decode.session import MethodRequest
from decode.verifiers import VERIFIERS, verifier_names

DEFAULT_ACTION = "2,2,4"
DEFAULT_VERIFIER = "traversal"
POLICY_FLAG = kind_names(lambda entry: entry.built_in)  # what --policy names: the policies with nothing to load


def add_decoding_arguments(parser: argparse.ArgumentParser) -> None:
    """The sampling and policy options shared by generate-like commands."""
    parser.add_argument("--method", default=None, metavar="VERIFIER@SPEC",
                        help="the verifier and the policy in one, as `ddte bench` and `ddte serve` take them: "
                        "VERIFIER@K,L1,L2, VERIFIER@adaptive, VERIFIER@entropy:threshold=H, VERIFIER@selector=FILE, "
                        "VERIFIER@expander=FILE, VERIFIER@policy=FILE ... (instead of --verifier and the policy flags)")
    parser.add_argument("--verifier", default=None,
                        help=f"the lossless verifier: {', '.join(verifier_names())} (default: traversal, or the "
                        "--policy-file's)")
    parser.add_argument("--policy", default="static",
                        help=f"{', '.join(POLICY_FLAG)}: static drafts --action every step; adaptive is HF's "
                        "+2/-1 schedule; entropy stops a single path where the draft is unsure")
    parser.add_argument("--action", default=None, metavar="K,L1,L2",
                        help=f"the static policy's tree shape (default {DEFAULT_ACTION})")
    parser.add_argument("--entropy-threshold", type=float, default=None,
                        help=f"entropy policy: stop above (nats; default {DEFAULT_ENTROPY_THRESHOLD:g})")
    parser.add_argument("--max-draft", type=int, default=None,
                        help=f"adaptive/entropy policies: longest draft (default {DEFAULT_MAX_DRAFT})")
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


# argparse reads a value that starts with '-' as an option unless it looks like a negative number; a comma-separated
# list of integers counts as one here, so `--action -1,2,2` reaches the action check and names what is wrong with K.
NEGATIVE_VALUES = re.compile(r"^-\d+$|^-\d*\.\d+$|^-\d+(,-?\d+)+$")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser._negative_number_matcher = NEGATIVE_VALUES
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


def check_arguments(args: argparse.Namespace) -> tuple[PolicySpec, list[int] | None]:
    """Every option checked with its flag's name, before any model is loaded; the policy --method or the flags
    name, and the --prompt-ids, read (None when the prompt is text)."""
    spec = method_flag(args).spec if args.method is not None else policy_spec(args)
    check_latency_argument(args.latency)
    if args.latency != "machine" and not spec.reads_file:
        raise UserError("--latency is the step-time model of a --selector, --expander or --policy-file: give one "
                        "of them, or leave --latency out")
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
        return spec, None
    if args.chat == "on":
        raise UserError("--chat on renders a text prompt through the chat template; --prompt-ids are token ids "
                        "already")
    try:
        ids = [int(x) for x in args.prompt_ids.split(",")]
    except ValueError as err:
        raise UserError(f"--prompt-ids must be comma-separated integers (no empty items), got "
                        f"'{args.prompt_ids}'") from err
    return spec, ids


def policy_spec(args: argparse.Namespace) -> PolicySpec:
    """The policy spec the policy flags name (decode/policies/spec.py), each flag refused where its policy does not
    read it."""
    if args.verifier is not None and args.verifier not in VERIFIERS:
        raise UserError(f"--verifier: unknown verifier '{args.verifier}'; known: {', '.join(verifier_names())}")
    if args.policy.lower() not in POLICY_FLAG:
        raise UserError(f"--policy: unknown policy '{args.policy}'; known: {', '.join(POLICY_FLAG)}")
    files = [(flag, kind, path) for flag, kind, path in (("--policy-file", "policy", args.policy_file),
                                                          ("--selector", "selector", args.selector),
                                                          ("--expander", "expander", args.expander)) if path]
    if files and (len(files) > 1 or args.policy != "static" or args.action):
        raise UserError(f"{files[0][0]} chooses the tree: do not combine it with --policy, --action, --selector, "
                        "--expander or --policy-file")
    if args.action is not None and args.policy != "static":
        raise UserError(f"--action is the static policy's shape; --policy {args.policy} does not use it")
    if args.entropy_threshold is not None and (files or args.policy != "entropy"):
        raise UserError("--entropy-threshold belongs to the entropy policy (--policy entropy)")
    if args.max_draft is not None and (files or args.policy == "static"):
        raise UserError("--max-draft belongs to the adaptive and entropy policies (--policy adaptive or entropy)")
    for flag, value, check in (("--max-draft", args.max_draft, check_max_draft),
                               ("--entropy-threshold", args.entropy_threshold, check_entropy_threshold)):
        with user_errors(ValueError):
            if value is not None:
                check(value, flag)
    with user_errors(ValueError, prefix="--action: " if args.policy == "static" and not files else ""):
        return parse_policy_spec(flags_spec_text(args, files[0][1:] if files else None))


def flags_spec_text(args: argparse.Namespace, file: tuple[str, str] | None) -> str:
    """What the policy flags spell in the SPEC grammar (decode/policies/spec.py), the one they are parsed by:
    ``KIND=FILE`` for ``file`` (its kind and path), ``--action`` (or the default tree) for the static policy,
    ``adaptive`` and ``entropy`` with the options given."""
    if file is not None:
        return f"{file[0]}={file[1]}"
    if args.policy == "static":
        return args.action or DEFAULT_ACTION
    options = [f"{name}={value!r}" for name, value in (("threshold", args.entropy_threshold),
                                                      ("max-draft", args.max_draft)) if value is not None]
    return args.policy + (":" + ",".join(options) if options else "")


def method_flag(args: argparse.Namespace) -> MethodRequest:
    """The method --method names, refused beside the flags it replaces."""
    given = [flag for flag, value in (("--verifier", args.verifier), ("--policy", args.policy != "static"),
                                      ("--action", args.action), ("--entropy-threshold", args.entropy_threshold),
                                      ("--max-draft", args.max_draft), ("--selector", args.selector),
                                      ("--expander", args.expander), ("--policy-file", args.policy_file))
             if value not in (None, False)]
    if given:
        raise UserError(f"--method names the verifier and the policy: do not combine it with {', '.join(given)}")
    if "@" not in args.method:
        raise UserError(f"--method {args.method!r}: use VERIFIER@SPEC, SPEC one of {SPEC_FORMS}")
    with user_errors(KeyError, ValueError, prefix=f"--method {args.method}: "):
        return MethodRequest.parse(args.method)


def run(args: argparse.Namespace) -> int:
    """One way down: the flags are checked and the output's folder made, the pair loads, then the session opens on
    it (decode/session.py: the policy checked against the pair, its file read once, this machine's kernels and
    latency table, the policy built), every sample runs at this call's sampling settings and the output is written
    whole."""
    from decode.drafting.sampling import SamplingConfig
    from decode.session import open_session

    spec, ids = check_arguments(args)
    apply_threads(args.threads)
    output = check_output_file(args.output) if args.output else None
    method, deployment = _method(args, spec)
    pair = load_pair_from_args(args)
    sampling = SamplingConfig(args.temperature, args.top_p)
    flag = "--method: " if args.method is not None else \
        {"policy": "--policy-file: ", "selector": "--selector: ", "expander": "--expander: "}.get(spec.kind, "")
    session = open_session(pair, method, args.kernels, args.latency, deployment=deployment,
                           hooks=shell_hooks(args, lambda step, _: flag, release=True))  # never runs stock
    ids = _prompt_ids(args, pair) if ids is None else ids
    note = session.policy.sampling_note(sampling)
    if note:
        print(note, file=sys.stderr)
    _samples(args, session.decoder, session.policy, ids, sampling, pair, output)
    return 0


def _samples(args: argparse.Namespace, decoder, policy, ids: list[int], sampling, pair, output) -> None:
    """Every sample, printed as it comes; the statistics on stderr; the output file written whole."""
    from ddte_core.paths import staged_file
    from decode.drafting.rng import TorchRandom
    from decode.stats import GenerationStats, plain_target_seconds

    total, plain_s = GenerationStats(), 0.0
    lines = []
    for i in range(args.num_samples):
        with user_errors():
            gen = decoder.generate(ids, args.max_new_tokens, policy, TorchRandom(args.seed + i), sampling)
        total.merge(gen.stats)
        if decoder.latency is not None:  # the run's latency table prices plain decoding's one-token passes
            plain_s += plain_target_seconds(lambda length: decoder.latency.target(length, 1), len(ids),
                                            gen.stats.new_tokens)
        record = {"sample": i, **gen.as_dict(pair.tokenizer)}
        lines.append(json.dumps(record) + "\n")
        print(f"--- sample {i} ({len(gen.tokens)} tokens, stopped by {gen.stopped_by})")
        print(record.get("text", ",".join(str(t) for t in gen.tokens)))
    print(f"verifier {decoder.verifier.name}, policy {policy.describe(sampling)}, T={args.temperature}, "
          f"top-p={args.top_p}: {total.summary()}", file=sys.stderr)
    print(total.vs_plain_decoding(plain_s if decoder.latency is not None else None), file=sys.stderr)
    if output is not None:
        try:
            with staged_file(output) as tmp:
                tmp.write_text("".join(lines))
        except OSError as err:
            raise UserError(f"cannot write {output}: {err.strerror}") from err
        print(f"wrote {len(lines)} samples to {output}", file=sys.stderr)


def _method(args: argparse.Namespace, spec: PolicySpec) -> tuple[MethodRequest, object | None]:
    """(the method, ``VERIFIER@SPEC`` parsed by its one grammar; the policy file read and checked whole, or None):
    before any model loads, as the policy file names the verifier unless --verifier (or --method) does."""
    from decode.policies.files.deployment import load_deployment
    from decode.verifiers import get_verifier

    deployment = None
    flag = f"--method {args.method}: " if args.method is not None else \
        {"policy": "--policy-file: ", "selector": "--selector: ", "expander": "--expander: "}.get(spec.kind, "")
    with user_errors(ValueError, prefix=flag):
        spec.check_file()
    if spec.kind == "policy":
        with user_errors(prefix="--policy-file: " if args.method is None else f"--method {args.method}: "):
            deployment = load_deployment(spec.path)
    if args.method is not None:
        return method_flag(args), deployment
    name = args.verifier or (deployment.verifier if deployment else DEFAULT_VERIFIER)
    with user_errors(prefix="--verifier: "):
        verifier = get_verifier(name)
    with user_errors(ValueError, prefix="--action: "):
        return MethodRequest.parse(f"{verifier.name}@{spec.text}"), deployment


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
