"""What real clients send to `ddte serve` and what they read back (issue 72), each through the real openai client, run
as one script inside a loopback-only network namespace (tests/ddte/test_serve_clients.py runs it through
tests/isolation.py), on the tiny pairs of tests/ddte/serve_cases.py.

``python -m tests.ddte.serve_client_cases FOLDER CASE...`` prints ``ok CASE (seconds)`` for each case that passed.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import urllib.request
from pathlib import Path

import openai as openai_module
import torch

from decode.drafting.sampling import SamplingConfig, distributions
from tests.ddte.serve_batch_cases import served_batch
from tests.ddte.serve_cases import (
    MODEL,
    PROMPT,
    GatedDecoder,
    SteppedDecoder,
    _metric,
    _queue_depth,
    client,
    post,
    run_cases,
    running,
    served,
    wait_until,
)

HI = [{"role": "user", "content": "hi"}]


def tokens_of(answer) -> list[int]:
    """The token ids ddte answered for one choice (an openai object or a dict)."""
    extra = answer if isinstance(answer, dict) else answer.model_extra
    return extra["ddte"]["token_ids"]


def case_accepted_forms(pairs: dict, folder: Path) -> None:
    """Content parts and the developer role; prompts as token ids, lists of ids and lists of strings (a choice
    each); n samples (sample i seeded seed + i), one at a time and as requests of one batch; best_of equal to n; a
    negative seed (unseeded)."""
    with running(served(pairs["chat"])) as base:
        openai = client(base)
        chat = openai.chat.completions.create
        plain = chat(model=MODEL, messages=[{"role": "system", "content": "be brief"}, {"role": "user",
                                                                                       "content": "h\ni"}],
                     max_tokens=8, seed=4)
        parts = chat(model=MODEL, messages=[{"role": "developer", "content": "be brief"}, {"role": "user", "content": [
            {"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}], max_tokens=8, seed=4)
        assert tokens_of(parts.choices[0]) == tokens_of(plain.choices[0])
        with_n = chat(model=MODEL, messages=HI, max_tokens=8, seed=10, n=3)
        alone = [tokens_of(chat(model=MODEL, messages=HI, max_tokens=8, seed=10 + i)) for i in range(3)]
        assert [c.index for c in with_n.choices] == [0, 1, 2]
        assert [tokens_of(c) for c in with_n.choices] == alone
        assert with_n.usage.completion_tokens == sum(len(a) for a in alone)
        tokenizer = served(pairs["chat"]).pair.tokenizer
        ids = tokenizer(PROMPT)["input_ids"]
        text = openai.completions.create
        one = tokens_of(text(model=MODEL, prompt=PROMPT, max_tokens=6, seed=3))
        other = tokens_of(text(model=MODEL, prompt="x = 1", max_tokens=6, seed=3))
        assert tokens_of(text(model=MODEL, prompt=ids, max_tokens=6, seed=3)) == one
        for prompt in ([ids, tokenizer("x = 1")["input_ids"]], [PROMPT, "x = 1"]):
            answer = text(model=MODEL, prompt=prompt, max_tokens=6, seed=3)
            assert [tokens_of(c) for c in sorted(answer.choices, key=lambda c: c.index)] == [one, other]
        both = text(model=MODEL, prompt=[PROMPT, "x = 1"], max_tokens=6, seed=3, n=2, best_of=2)
        assert [tokens_of(c) for c in both.choices][::2] == [one, other] and len(both.choices) == 4
        streamed: dict[int, str] = {}
        for chunk in text(model=MODEL, prompt=[PROMPT, "x = 1"], max_tokens=6, seed=3, stream=True):
            for c in chunk.choices:
                streamed[c.index] = streamed.get(c.index, "") + c.text
        whole = text(model=MODEL, prompt=[PROMPT, "x = 1"], max_tokens=6, seed=3)
        assert streamed == {c.index: c.text for c in whole.choices}
        unseeded = text(model=MODEL, prompt=PROMPT, max_tokens=4, seed=-1)
        assert unseeded.model_extra["ddte"]["seed"] >= 0
    with running(served_batch(pairs["chat"])) as base:  # --max-batch 4: the three samples decode together
        together = client(base).chat.completions.create(model=MODEL, messages=HI, max_tokens=8, seed=10, n=3)
        assert [tokens_of(c) for c in together.choices] == alone
        assert _metric(base, 'ddte_batch_size_bucket{le="1"}') < _metric(base, "ddte_batch_size_count")


def case_refused_and_ignored(pairs: dict, folder: Path) -> None:
    """Vendor fields that change neither the law nor the answer are ignored; those that would change the law and
    that ddte does not implement are one clear 400 naming the field and why; so are other content parts, best_of
    beyond n and more choices than the queue holds."""
    with running(served(pairs["chat"], max_queue=8)) as base:
        openai = client(base)
        ignored = {"return_token_ids": True, "cache_prompt": False, "skip_special_tokens": True,
                   "repetition_penalty": 1.0, "min_tokens": 0, "stream_options": None, "ignore_eos": False}
        assert openai.chat.completions.create(model=MODEL, messages=HI, max_tokens=3, extra_body=ignored).choices
        refused = [{"logit_bias": {"5": 2}}, {"presence_penalty": 0.5}, {"frequency_penalty": 0.5},
                   {"repetition_penalty": 1.1}, {"min_tokens": 4}, {"tools": [{"type": "function"}]}, {"best_of": 3},
                   {"n": 9}]
        for body in refused:
            param = next(iter(body))
            try:
                openai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, extra_body=body)
            except openai_module.BadRequestError as err:
                assert err.body["param"] == param and len(err.body["message"].splitlines()) == 1, err.body
            else:
                raise AssertionError(f"{body} was served")
        for word in ("penalty", "min_tokens"):
            status, answer = post(base, "/v1/completions", {"model": MODEL, "prompt": PROMPT, **(
                {"repetition_penalty": 1.3} if word == "penalty" else {"min_tokens": 2})})
            assert status == 400 and "exactness" in answer["error"]["message"], answer
        try:
            openai.chat.completions.create(model=MODEL, max_tokens=3, messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}])
        except openai_module.BadRequestError as err:
            assert "only text parts" in err.body["message"] and "'image_url'" in err.body["message"], err.body
        else:
            raise AssertionError("an image part was served")


def recompute(pairs: dict, ids: list[int], sampling: SamplingConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The chat pair's target over ``ids``: (raw log-probabilities, log-laws under ``sampling``), ``(len, V)``."""
    target = served(pairs["chat"]).pair.target
    with torch.inference_mode():
        logits = target.model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, -1), distributions(logits, sampling).log()


def case_logprobs(pairs: dict, folder: Path) -> None:
    """logprobs (completions: k; chat: with top_logprobs k) of each token under the law sampled, as a plain recompute
    gives them, streamed as whole; echo with the prompt's under the raw law (its first token null), and max_tokens
    0 answering the prompt's alone: what lm-eval's loglikelihood requests read."""
    with running(served(pairs["chat"])) as base:
        openai = client(base)
        ids = served(pairs["chat"]).pair.tokenizer(PROMPT)["input_ids"]
        sampling = SamplingConfig(0.8, top_k=50)
        whole = openai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, seed=2, temperature=0.8,
                                          logprobs=3, echo=True, extra_body={"top_k": 50})
        got = whole.choices[0].logprobs
        new = tokens_of(whole)
        raw, laws = recompute(pairs, ids + new, sampling)
        assert got.token_logprobs[0] is None and got.top_logprobs[0] is None and len(got.tokens) == len(ids + new)
        for i in range(1, len(ids)):
            assert abs(got.token_logprobs[i] - float(raw[i - 1, ids[i]])) < 1e-3
        for j, token in enumerate(new):
            assert abs(got.token_logprobs[len(ids) + j] - float(laws[len(ids) + j - 1, token])) < 1e-3
            assert 3 <= len(got.top_logprobs[len(ids) + j]) <= 4
        assert whole.choices[0].text.startswith(PROMPT)
        chunks = list(openai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, seed=2, temperature=0.8,
                                                logprobs=3, echo=True, stream=True, extra_body={"top_k": 50}))
        joined = [lp for c in chunks if c.choices and c.choices[0].logprobs
                  for lp in c.choices[0].logprobs.token_logprobs]
        assert joined == got.token_logprobs
        assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
        scored = openai.completions.create(model=MODEL, prompt=[ids, ids[:4]], max_tokens=0, logprobs=1, echo=True,
                                           temperature=0)
        assert [len(c.logprobs.token_logprobs) for c in scored.choices] == [len(ids), 4]
        assert scored.usage.completion_tokens == 0 and scored.choices[0].text == PROMPT
        assert all(abs(a - b) < 1e-4 for a, b in zip(scored.choices[0].logprobs.token_logprobs[1:],
                                                      got.token_logprobs[1:len(ids)], strict=True))
        greedy = openai.chat.completions.create(model=MODEL, messages=HI, max_tokens=6, temperature=0,
                                                logprobs=True, top_logprobs=2)
        content = greedy.choices[0].logprobs.content
        assert len(content) == greedy.usage.completion_tokens and all(t.logprob == 0.0 for t in content)
        assert all([top.logprob for top in t.top_logprobs] == [0.0, -9999.0] for t in content)
        assert all(bytes(t.bytes).decode(errors="replace") == t.token or t.token.startswith("bytes:")
                   for t in content)
        parts = [c.choices[0].logprobs.content for c in openai.chat.completions.create(
            model=MODEL, messages=HI, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2, stream=True)
            if c.choices and c.choices[0].logprobs]
        assert [t.token for part in parts for t in part] == [t.token for t in content]


def same_pair(pairs: dict, folder: Path) -> Path:
    """The chat pair with its target as its own draft: every draft token is accepted, so a step emits 4."""
    chat = json.loads(pairs["chat"].read_text())
    path = folder / "same.yaml"
    path.write_text(json.dumps({**chat, "draft": chat["target"]}))
    return path


def case_usage_and_stream(pairs: dict, folder: Path) -> None:
    """Usage counts the tokens answered, up to the one that completed the stop string, though its step accepted
    more; a stream's first chunk (the chat role) comes with the first token, not before the request ran."""
    with running(served(same_pair(pairs, folder))) as base:
        openai = client(base)
        tokenizer = served(pairs["chat"]).pair.tokenizer
        full = openai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
        ids = tokens_of(full)
        assert full.model_extra["ddte"]["mean_acceptance_length"] == 4.0, full.model_extra["ddte"]
        j = next(j for j in (1, 2) if (added := tokenizer.decode(ids[:j + 1])[len(tokenizer.decode(ids[:j])):])
                 and added not in tokenizer.decode(ids[:j]))
        stop = tokenizer.decode(ids[:j + 1])[len(tokenizer.decode(ids[:j])):]
        kept = next(m for m in range(1, 13) if stop in tokenizer.decode(ids[:m]))
        for stream in (False, True):
            if stream:
                chunks = list(openai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                                        stop=stop, stream=True,
                                                        stream_options={"include_usage": True}))
                usage, text = chunks[-1].usage, "".join(c.choices[0].text for c in chunks if c.choices)
            else:
                cut = openai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stop=stop)
                usage, text = cut.usage, cut.choices[0].text
                assert tokens_of(cut) == ids[:kept]
            whole = full.choices[0].text
            assert usage.completion_tokens == kept < 4 and text == whole[:whole.index(stop)]
    gate = threading.Event()
    serve = served(pairs["chat"])
    serve.decoder = SteppedDecoder(serve.decoder, gate)
    with running(serve) as base:
        first: list = []

        def read() -> None:
            for chunk in client(base).chat.completions.create(model=MODEL, messages=HI, max_tokens=4, stream=True):
                first.append((time.monotonic(), chunk))
        reader = threading.Thread(target=read)
        reader.start()
        wait_until(lambda: _metric(base, "ddte_requests_running") == 1, "the request never started")
        time.sleep(1.0)
        assert not first, "a chunk went before the first step ran"
        opened = time.monotonic()
        gate.set()
        reader.join(60)
        assert first[0][0] >= opened and first[0][1].choices[0].delta.role == "assistant"


def case_http(pairs: dict, folder: Path) -> None:
    """An unknown model is 404 (the client's NotFoundError), /v1/models/{id} answers, a full queue's 429 says
    Retry-After, every response names one short system_fingerprint, and --cors-origin answers a preflight."""
    gate = threading.Event()
    serve = served(pairs["chat"], max_queue=1)
    serve.decoder = GatedDecoder(serve.decoder, gate)
    with running(serve) as base:
        openai = client(base)
        for call in (lambda: openai.completions.create(model="gpt-4", prompt=PROMPT),
                     lambda: openai.chat.completions.create(model="gpt-4", messages=HI),
                     lambda: openai.models.retrieve("gpt-4")):
            try:
                call()
            except openai_module.NotFoundError as err:
                assert err.body["code"] == "model_not_found", err.body
            else:
                raise AssertionError("an unknown model was answered")
        assert openai.models.retrieve(MODEL).id == MODEL
        held = [threading.Thread(target=post, args=(base, "/v1/completions", {"model": MODEL, "prompt": PROMPT,
                                                                                "max_tokens": 2})) for _ in range(2)]
        held[0].start()
        wait_until(lambda: _metric(base, "ddte_requests_running") == 1, "the first request never started")
        held[1].start()
        wait_until(lambda: _queue_depth(base) == 1, "the second request never queued")
        try:
            openai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
        except openai_module.RateLimitError as err:
            assert err.response.headers["retry-after"] == "1", err.response.headers
        else:
            raise AssertionError("a full queue answered")
        gate.set()
        for thread in held:
            thread.join(60)
        chat = openai.chat.completions.create(model=MODEL, messages=HI, max_tokens=2)
        chunks = list(openai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, stream=True))
        prints = {chat.system_fingerprint, *(c.system_fingerprint for c in chunks)}
        assert len(prints) == 1 and prints.pop().startswith("fp_") and len(chat.system_fingerprint) == 15
        assert _preflight(base) == 405  # no CORS unless asked
    cors = served(pairs["chat"])
    cors.cors_origins = ("http://ui.test",)
    with running(cors) as base:
        assert _preflight(base) == 200
        assert client(base).chat.completions.create(model=MODEL, messages=HI, max_tokens=2).system_fingerprint == \
            chat.system_fingerprint  # the same pair, kernels and method: the same fingerprint


def _preflight(base: str) -> int:
    request = urllib.request.Request(base + "/v1/chat/completions", method="OPTIONS", headers={
        "Origin": "http://ui.test", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type,authorization"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.headers["access-control-allow-origin"] == "http://ui.test", dict(response.headers)
            return response.status
    except urllib.error.HTTPError as err:
        return err.code


def case_ignore_eos(pairs: dict, folder: Path) -> None:
    """ignore_eos decodes past EOS up to max_tokens: with the greedy answer's first token taken as EOS, a request
    stops after it, and the same request with ignore_eos goes on."""
    serve = served(pairs["chat"])
    with running(serve) as base:
        openai = client(base)
        first = tokens_of(openai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0))
        serve.decoder.eos_token_id = first[0]
        stops = openai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
        goes = openai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
                                         extra_body={"ignore_eos": True})
        assert (stops.usage.completion_tokens, stops.choices[0].finish_reason) == (1, "stop")
        assert (goes.usage.completion_tokens, goes.choices[0].finish_reason) == (6, "length")
        assert tokens_of(goes)[:len(first)] == first


def case_exact_law_filtered(pairs: dict, folder: Path) -> None:
    """The first two tokens of 800 seeded requests under top_k and min_p (T 1.2), against the target's exact law
    under the same transform (χ²); the same counts against the law without them must fail, and each filter removes
    outcomes the other keeps (both act)."""
    from tests.decode.test_lossless import P_VALUE, SAMPLES, chi2_p_value
    from tests.decode.test_lossless import PROMPT as IDS

    sampling = SamplingConfig(1.2, top_k=6, min_p=0.3)
    counts: dict = {}
    with running(served(pairs["toy"], "specinfer@1,4,0", eos=False)) as base:
        for seed in range(SAMPLES):
            status, answer = post(base, "/v1/completions", {"model": MODEL, "prompt": IDS, "max_tokens": 2,
                                                            "seed": seed, "temperature": 1.2, "top_k": 6,
                                                            "min_p": 0.3})
            assert status == 200, answer
            key = tuple(answer["ddte"]["token_ids"])
            counts[key] = counts.get(key, 0) + 1
    laws = {s: two_token_law(pairs["toy"], IDS, s) for s in (sampling, SamplingConfig(1.2, top_k=6),
                                                             SamplingConfig(1.2, min_p=0.3), SamplingConfig(1.2))}
    cut = [sum(p == 0 for p in law.values()) for law in laws.values()]
    assert cut[0] > max(cut[1:]), f"top_k and min_p do not each cut: {cut}"  # each filter acts on this law
    exact = laws[sampling]
    assert all(exact[cell] > 0 for cell in counts), "a sample the filtered law cannot produce"
    assert chi2_p_value(exact, counts) > P_VALUE
    assert chi2_p_value(laws[SamplingConfig(1.2)], counts) < P_VALUE


def two_token_law(pair_yaml: Path, ids: list[int], sampling: SamplingConfig) -> dict[tuple[int, int], float]:
    """The toy target's exact law of the first two tokens after ``ids`` under ``sampling``, by (a, b)."""
    from decode.pair import load_pair_config

    pair = load_pair_config(pair_yaml)
    with torch.inference_mode():
        first = distributions(pair.target.model(torch.tensor([ids])).logits[0, -1].double(), sampling)
        second = distributions(pair.target.model(torch.tensor([ids + [a] for a in range(8)])).logits[:, -1].double(),
                               sampling)
    return {(a, b): float(first[a] * second[a, b]) for a in range(8) for b in range(8)}


def main(argv: list[str]) -> int:
    return run_cases(globals(), argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
