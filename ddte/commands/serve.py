"""Serve the pair behind an OpenAI-compatible HTTP API: what `ddte pipeline` deployed, or any ddte method.

Endpoints: POST /v1/chat/completions (messages through the pair's chat template: a pair that has one, such as
qwen-coder; the shipped pair has none) and /v1/completions, with temperature, top_p, top_k, min_p, max_tokens, seed,
stop, ignore_eos, n, logprobs (and a completion's echo) and stream (server-sent events in OpenAI's chunk format);
GET /v1/models, /v1/models/ID, /health, and /metrics (Prometheus text: requests by outcome, tokens, draft and
accepted tokens, mean acceptance length, TTFT and TPOT histograms, policy decisions by action, queue depth, the
process's resident memory and its peak). Every response's usage comes with a "ddte" object: steps, mean acceptance
length, the actions the policy chose. Sampling settings are per request; each request is exactly the target's law at
its own settings, and a request with a seed gives what `ddte generate --seed` gives. Fields that would change that
law and that ddte does not implement (penalties, logit_bias, min_tokens, constrained decoding) are refused with the
reason; other unknown fields are ignored. --cors-origin lets browser pages at that origin call the server.

One pair is loaded. Every request runs on the one decoding step: by default one at a time, in arrival order
(--max-batch 1); with --max-batch N up to N decode together (continuous batching: a request joins the running batch
between steps as a slot frees, and leaves when done or cancelled; one target pass per step over every request's
tree), each still exactly the target's law at its own settings and with its own policy, a selector's or an
expander's included (a seeded one gives the same tokens as alone, except where a draw falls within float rounding
of a boundary: its rows are summed in another order). At most --max-queue wait beyond
the batch, and one more gets 429 at once. A body over --max-body-kib gets 413; a bad one
400, with an OpenAI error object. A client that disconnects ends its generation at the next step. Ctrl-C or SIGTERM
stops accepting, answers the queued requests 503 at once, lets the running request finish (for at most 30 s, then
cuts it), and exits 0. Built on FastAPI and uvicorn; it listens on 127.0.0.1 unless --host says otherwise, and prints
the URL it is bound to (--port 0: a free port, printed).

Examples:
  ddte serve --policy-file runs/pipeline/policy.json
  ddte serve --pair qwen-coder --method traversal@1,2,0 --port 8000
  curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
      -d '{"model": "ddte", "prompt": "def fib(n):", "max_tokens": 32}'
  curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
      -d '{"model": "ddte", "messages": [{"role": "user", "content": "def fib(n):"}], "max_tokens": 32}'
      (chat needs a pair with a chat template, e.g. --pair qwen-coder)
"""

from __future__ import annotations

import argparse
import sys

from ddte.commands.common import (
    UserError,
    add_latency_argument,
    add_pair_arguments,
    add_threads_argument,
    apply_threads,
    check_latency_argument,
    load_pair_from_args,
    shell_hooks,
    user_errors,
)
from ddte.serve.server import DEFAULT_MAX_BODY_BYTES, listen_socket, url_of

DEFAULT_METHOD = "traversal@1,3,0"
DEFAULT_MAX_BATCH = 1
MAX_BATCH_HELP = ("requests decoded together (continuous batching on one shared KV cache), each with the served "
                  "policy, a selector's or an expander's included; 1 runs them one at a time. Default 1. Batching "
                  "several clients raises their output tokens/s together and cuts their time to the first token, "
                  "but raises each request's TPOT; alone a request runs no slower (docs/results.md, 'Serving'). 1 "
                  "stays the default because it keeps each request's latency, which speculative decoding is for. "
                  "Raise it where several users share a server")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_pair_arguments(parser)
    parser.add_argument("--method", default=None, metavar="VERIFIER@SPEC",
                        help=f"how to decode, as in `ddte bench`: VERIFIER@K,L1,L2, VERIFIER@selector=FILE, "
                        f"VERIFIER@expander=FILE, VERIFIER@adaptive ... (default: {DEFAULT_METHOD}, or the policy "
                        "file's verifier). VERIFIER@shared[:max-draft=D]: with --max-batch above 1, one draft budget "
                        "shared across the batch: each step one chain length (0 to D, default 6) for every request, "
                        "the one with the most expected tokens per ms on this machine's latency table, each "
                        "request's acceptance estimated from its own earlier steps (so each stays the target's law): "
                        "the best static chain at the batch's size; alone, the best chain for the one request")
    parser.add_argument("--policy-file", default=None, metavar="policy.json",
                        help="serve what `ddte pipeline` chose (its verifier, unless --verifier names another)")
    parser.add_argument("--verifier", default=None, help="with --policy-file: the verifier whose choices to serve")
    parser.add_argument("--model-name", default="ddte", help="the model name clients send (GET /v1/models)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free port)")
    parser.add_argument("--max-queue", type=int, default=16, help="requests that may wait; one more gets 429")
    parser.add_argument("--max-batch", type=int, default=DEFAULT_MAX_BATCH, metavar="N",
                        help=MAX_BATCH_HELP)
    parser.add_argument("--default-max-tokens", type=int, default=256,
                        help="max_tokens of a request that gives none (capped by the context)")
    parser.add_argument("--max-body-kib", type=_positive_kib, default=DEFAULT_MAX_BODY_BYTES // 1024,
                        help="the largest request body, in KiB; a larger one gets 413")
    parser.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN", type=_origin,
                        help="a web origin (e.g. http://localhost:3000, or * for any) whose pages may call the "
                        "server: CORS headers and preflight OPTIONS answered for it (repeatable; default: none)")
    add_threads_argument(parser)
    add_latency_argument(parser)


def check_arguments(args: argparse.Namespace):
    """Every flag checked before the pair loads; (the verifier's name, the policy spec to serve, the policy file read
    and checked whole or None)."""
    from decode.policies.kinds import SPEC_FORMS
    from decode.policies.spec import parse_verifier_spec

    if not 0 <= args.port <= 65535:
        raise UserError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_queue < 1 or args.default_max_tokens < 1 or args.max_batch < 1:
        raise UserError("--max-queue, --max-batch and --default-max-tokens must be >= 1")
    if not args.model_name.strip():
        raise UserError("--model-name must not be empty")
    check_port(args.host, args.port)
    check_latency_argument(args.latency)
    if args.policy_file and args.method:
        raise UserError("--policy-file chooses the method: do not combine it with --method")
    if args.verifier and not args.policy_file:
        raise UserError("--verifier goes with --policy-file (a --method names its own verifier)")
    if args.policy_file:
        from decode.policies.files.deployment import load_deployment
        from decode.policies.spec import PolicySpec
        from decode.verifiers import get_verifier

        with user_errors(prefix="--policy-file: "):
            deployment = load_deployment(args.policy_file)
            verifier = get_verifier(args.verifier or deployment.verifier).name
            deployment.choices_of(verifier)
        return verifier, PolicySpec.file("policy", args.policy_file), deployment
    text = args.method or DEFAULT_METHOD
    if "@" not in text or "+draft=" in text:  # what bench takes beside ddte's methods
        raise UserError(f"--method {text!r}: serve runs a ddte method VERIFIER@SPEC on the pair's own draft, SPEC "
                        f"one of {SPEC_FORMS} (e.g. traversal@1,2,0)")
    with user_errors(KeyError, ValueError, prefix=f"--method {text}: "):
        verifier, spec = parse_verifier_spec(text)
    with user_errors(ValueError, prefix="--method: "):
        spec.check_file()
    return verifier, spec, None


def run(args: argparse.Namespace) -> int:
    from ddte.serve.app import Served, create_app
    from ddte.serve.server import serve
    from ddte_core.memory import gigabytes, peak_rss_bytes
    from decode.session import MethodRequest, open_session
    from decode.verifiers import get_verifier

    verifier, spec, deployment = check_arguments(args)
    apply_threads(args.threads)
    pair = load_pair_from_args(args)
    if pair.tokenizer is None:
        raise UserError("the pair has no tokenizer: pass --tokenizer DIR")
    # the policy checked against the pair before any timing, then this machine's kernels and latency table
    session = open_session(pair, MethodRequest(verifier, spec), args.kernels, args.latency, deployment=deployment,
                           hooks=shell_hooks(args, release=True), batch=args.max_batch)  # never runs stock
    policy, decoder = session.policy, session.decoder
    method = f"{verifier}@{spec.text}"
    served = Served(args.model_name, pair, decoder, policy, method, args.max_queue, args.default_max_tokens,
                    args.max_body_kib * 1024, args.max_batch, get_verifier(verifier), tuple(args.cors_origin))
    with user_errors(OSError):
        sock = listen_socket(args.host, args.port)
    app = create_app(served)
    batching = f", batches of up to {args.max_batch}" if args.max_batch > 1 else ""
    print(f"serving {method} as model {args.model_name!r}{batching} on {url_of(sock)} (peak RSS "
          f"{gigabytes(peak_rss_bytes())}; Ctrl-C stops)", file=sys.stderr, flush=True)
    serve(app, sock, app.state.worker)
    return 0


def check_port(host: str, port: int) -> None:
    """UserError when ``host:port`` cannot be listened on (in use, or not an address here), before models load."""
    with user_errors(OSError):
        listen_socket(host, port).close()


def _positive_kib(text: str) -> int:
    """argparse ``type`` of --max-body-kib: a whole number of KiB, at least 1."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"a whole number of KiB >= 1, got '{text}'")
    return int(text)


def _origin(text: str) -> str:
    """argparse ``type`` of --cors-origin: ``*`` or a web origin ``http(s)://host[:port]`` (no path)."""
    from urllib.parse import urlsplit

    parts = urlsplit(text)
    if text != "*" and (parts.scheme not in ("http", "https") or not parts.netloc or parts.path or parts.query):
        raise argparse.ArgumentTypeError(f"an origin such as http://localhost:3000 (or * for any), got '{text}'")
    return text
