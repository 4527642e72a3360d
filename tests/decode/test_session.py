"""The session builder (decode/session.py): its steps in their one order, each once, on the tiny models of
tests/factories.py."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import pytest

from decode.cost.table import LatencyTable
from decode.drafting.rng import TorchRandom
from decode.drafting.sampling import SamplingConfig
from decode.pair import LoadedPair
from decode.policies.files.deployment import Choice, Deployment
from decode.session import Hooks, LatencyRequest, MethodRequest, PairRequest, open_pair, open_session, open_sessions
from tests.factories import SHIPPED_TOKENIZER, save_tiny_pair

KERNELS = "target=default,draft=int8-dynamic"  # a path of the draft's own, the target's measured not
TABLE = LatencyTable([8, 32], [1, 4], [[1.0, 2.0], [1.5, 2.5]], [[5.0, 6.0], [7.0, 9.0]])


@pytest.fixture(scope="module")
def pair_yaml(tmp_path_factory) -> Path:
    """A tiny pair whose draft has the target's hidden size, as the decoding tests' selector file expects."""
    return save_tiny_pair(tmp_path_factory.mktemp("pair"), draft_hidden=32) / "pair.yaml"


@pytest.fixture(scope="module")
def pair_selector(pair_yaml, selector_file, tmp_path_factory) -> Path:
    """The decoding tests' selector file (specinfer), made for the tiny pair."""
    from tests.decode.selectors import with_metadata

    fingerprint = PairRequest(pair_yaml).load().fingerprint()
    return with_metadata(selector_file, tmp_path_factory.mktemp("selector") / "pair.onnx", "ddte.pair_fingerprint",
                         fingerprint)


def policy_file(folder: Path, fingerprint: str = "") -> Path:
    """A policy file of two static choices for traversal (``fingerprint``: the pair it claims; empty: any)."""
    return Deployment([Choice("traversal", 0.7, 1.0, "static", "2,1,2"), Choice("traversal", 1.0, 1.0, "static",
                                                                                "1,3,0")],
                      "traversal", fingerprint).write(folder / "policy.json")


@pytest.fixture
def steps(monkeypatch) -> list[str]:
    """What ran, in order: each step the builder entered (its ``errors`` hook) and each library call it made there,
    with the kernel path the draft ran when a latency table was read or measured."""
    import decode.cost.measure as latency
    import decode.engine
    import decode.policies.build as deployment

    seen: list[str] = []

    def spy(module, name: str, label: str, kernel: bool = False) -> None:
        original = getattr(module, name)

        def wrapped(*args, **kwargs):  # a table's arguments: the target, then the draft
            seen.append(label + (f"[{args[1].kernel}]" if kernel else ""))
            return original(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapped)

    spy(deployment, "load_policy_spec", "check")
    spy(deployment, "build_policy", "build_policy")
    spy(latency, "machine_table", "machine_table", kernel=True)
    spy(latency, "machine_batch_cost", "machine_batch_cost", kernel=True)
    spy(latency, "loop_table", "loop_table", kernel=True)
    spy(decode.engine, "SpeculativeDecoder", "decoder")
    use_kernels = LoadedPair.use_kernels

    def kernels(self, *args, **kwargs):
        seen.append("use_kernels")
        return use_kernels(self, *args, **kwargs)

    monkeypatch.setattr(LoadedPair, "use_kernels", kernels)
    return seen


def hooks(seen: list[str], tmp_path: Path, lines: list[str] | None = None) -> Hooks:
    @contextmanager
    def errors(step: str, method):
        seen.append(f"<{step}>")
        yield

    return Hooks(report=None if lines is None else lines.append, errors=errors, cache=tmp_path / "cache")


def test_a_batch_sessions_table_also_prices_the_batchs_passes(pair_yaml, tmp_path, steps):
    """A shared budget in a batch: the machine's table, then what a batch's passes cost beyond it (measured once and
    cached in a file of its own), which the budget's table carries; a session of one request's loop measures none."""
    lines: list[str] = []
    session = open_session(PairRequest(pair_yaml), "traversal@shared", KERNELS, "machine", batch=4,
                           hooks=hooks(steps, tmp_path, lines))
    assert steps[steps.index("<latency>"):] == ["<latency>", "machine_table[int8-dynamic]",
                                                "machine_batch_cost[int8-dynamic]", "<build>", "build_policy"]
    cost = session.latency.batch
    assert cost is not None and cost.sequences[0] == 1 and "int8-dynamic" in cost.machine
    assert session.policy.start(SamplingConfig(1.0)).table.batch == cost  # the budget prices batch passes
    assert "batch passes" in session.latency_line and str(tmp_path / "cache") in session.latency_line
    steps.clear()
    alone = open_session(PairRequest(pair_yaml), "traversal@shared", KERNELS, "machine", hooks=hooks(steps, tmp_path))
    assert "machine_batch_cost[int8-dynamic]" not in steps and alone.latency.batch is None


def test_the_steps_run_in_their_one_order_and_the_table_times_the_kernels_chosen(pair_yaml, tmp_path, steps):
    """Parse, load, check, kernels, then this machine's table (on the draft's new path, which its identity names),
    then build; every result line reported as its step ends and kept as data."""
    lines: list[str] = []
    session = open_session(PairRequest(pair_yaml), f"traversal@policy={policy_file(tmp_path)}", KERNELS,
                           "machine", hooks=hooks(steps, tmp_path, lines))
    assert steps == ["<method>", "<method>", "<pair>", "<policy>", "check", "<kernels>", "use_kernels", "<latency>",
                     "machine_table[int8-dynamic]", "<build>", "build_policy", "decoder"]
    assert session.pair.draft.kernel == "int8-dynamic" and session.kernel_choice.draft == "int8-dynamic"
    assert "int8-dynamic" in session.latency.machine  # the table's identity includes the path it timed
    assert session.decoder.latency is session.latency  # it also prices plain decoding in generate's summary
    assert lines == list(session.lines) == [session.kernel_choice.line(), session.latency_line]
    assert session.latency_line.startswith("step times: this machine's latency table (")
    assert session.decoding.method == MethodRequest.parse(f"traversal@policy={tmp_path / 'policy.json'}")
    generation = session.decoder.generate([5, 6, 7], 4, session.policy, TorchRandom(0), SamplingConfig(1.0))
    assert generation.stats.new_tokens == 4


def test_a_method_that_does_not_parse_raises_before_the_pair_loads(tmp_path, steps):
    request = PairRequest(target=tmp_path / "missing", draft=tmp_path / "missing")
    with pytest.raises(ValueError, match="not lossless"):
        open_session(request, "block@2,0,3", hooks=hooks(steps, tmp_path))
    with pytest.raises(KeyError, match="bogus"):
        open_sessions(request, ["traversal@1,3,0", "bogus@1,3,0"], hooks=hooks(steps, tmp_path))
    assert steps == ["<method>", "<method>"]


def test_a_spec_refused_by_the_pair_raises_before_any_kernel_is_measured(pair_yaml, tmp_path, steps):
    pair = PairRequest(pair_yaml).load()
    with pytest.raises(ValueError, match="another pair"):
        open_session(pair, f"traversal@policy={policy_file(tmp_path, '0' * 64)}", "auto",
                     hooks=hooks(steps, tmp_path))
    assert steps == ["<method>", "<method>", "<policy>", "check"] and pair.kernel_choice is None
    assert not (tmp_path / "cache").exists()  # nothing measured, nothing cached


def test_a_selector_for_another_verifier_raises_before_any_kernel_is_measured(pair_yaml, pair_selector, tmp_path,
                                                                             steps):
    pair = PairRequest(pair_yaml).load()
    with pytest.raises(ValueError, match="specinfer"):
        open_session(pair, f"traversal@selector={pair_selector}", "auto", hooks=hooks(steps, tmp_path))
    assert "use_kernels" not in steps and pair.kernel_choice is None


def test_a_selector_without_a_table_gets_one_measured_after_the_kernels(pair_yaml, pair_selector, tmp_path, steps):
    """``fitted``: the selector's fallbacks as fitted (no table for the policy), and the decoder the pass times its
    root features read, measured by the builder on the models' paths; the engine never measures one."""
    session = open_session(PairRequest(pair_yaml), f"specinfer@selector={pair_selector}", KERNELS,
                           LatencyRequest("fitted"), hooks=hooks(steps, tmp_path))
    assert steps.index("use_kernels") < steps.index("loop_table[int8-dynamic]") < steps.index("build_policy")
    assert "machine_table" not in " ".join(steps)
    assert session.latency is None and isinstance(session.decoder.latency, LatencyTable)
    assert session.latency_line == "step times: each policy file's fallback as fitted (--latency fitted)"
    generation = session.decoder.generate([5, 6, 7], 4, session.policy, TorchRandom(0), SamplingConfig(1.0))
    assert generation.stats.new_tokens == 4


def test_the_engine_never_measures_a_table_itself(pair_yaml, pair_selector):
    from decode.engine import SpeculativeDecoder
    from decode.policies.selector import SelectorSource
    from decode.verifiers import get_verifier

    pair = PairRequest(pair_yaml).load()
    policy = SelectorSource.for_pair(pair_selector, "specinfer", pair)
    decoder = SpeculativeDecoder(pair.target, pair.draft, get_verifier("specinfer"), pair.eos_token_id)
    with pytest.raises(ValueError, match="reads root features"):
        decoder.generate([5, 6, 7], 4, policy, TorchRandom(0), SamplingConfig(1.0))
    assert decoder.latency is None


def test_methods_of_one_verifier_and_draft_share_a_decoder_and_a_table_file_is_checked(pair_yaml, tmp_path, steps):
    pair = PairRequest(pair_yaml).load()
    table = tmp_path / "table.json"
    table.write_text(LatencyTable(**{**TABLE.__dict__, "pair": pair.fingerprint()}).to_json())
    methods = ["traversal@2,1,2", "traversal@adaptive", "specinfer@1,3,0", "traversal@2,1,2",
               f"traversal@policy={policy_file(tmp_path)}"]
    session = open_sessions(pair, methods, "default", str(table), hooks=hooks(steps, tmp_path))
    static, adaptive, other, from_file = session.decodings.values()  # a repeat is opened once
    assert static.decoder is adaptive.decoder is from_file.decoder is not other.decoder
    assert steps.count("decoder") == 2 and session.latency.pair == pair.fingerprint()
    assert session.latency_line == f"step times: latency table {table}"
    other_pair = tmp_path / "other.json"
    other_pair.write_text(LatencyTable(**{**TABLE.__dict__, "pair": "0" * 64}).to_json())
    with pytest.raises(ValueError, match="another pair"):
        open_sessions(pair, methods, "default", LatencyRequest(str(other_pair)))


def test_another_draft_runs_on_the_pairs_draft_path_after_the_kernels(pair_yaml, tmp_path, steps):
    """bench's ``+draft=``: another draft folder, loaded once after the kernels step, on the draft's path there."""
    draft = pair_yaml.parent / "draft"
    requests = [MethodRequest.parse("traversal@2,1,2"), MethodRequest.parse("traversal@2,1,2", str(draft)),
                MethodRequest.parse("traversal@adaptive", str(draft))]
    session = open_sessions(PairRequest(pair_yaml), requests, KERNELS, hooks=hooks(steps, tmp_path))
    own, other, adaptive = (session.decodings[r] for r in requests)
    assert own.decoder is not other.decoder and other.decoder is adaptive.decoder
    assert other.decoder.draft is not session.pair.draft and other.decoder.draft.kernel == "int8-dynamic"
    assert steps.index("use_kernels") < steps.index("<drafts>") and steps.count("<drafts>") == 1
    assert session.latency is None and other.decoder.latency is None and session.lines == (
        session.kernel_choice.line(),)  # no policy reads a table: none is read, none measured


def test_open_pair_applies_the_kernels_and_opens_no_decoder(pair_yaml, tmp_path, steps):
    pair = PairRequest(pair_yaml).load()
    session = open_pair(pair, None, hooks(steps, tmp_path))  # None: the pair's own request (auto)
    assert steps == ["<method>", "<kernels>", "use_kernels"] and session.pair is pair
    assert pair.kernel_choice is session.kernel_choice and session.lines == (session.kernel_choice.line(),)
    assert (tmp_path / "cache").is_dir() and not session.decodings  # auto measured once and cached
    with pytest.raises(ValueError, match="0 methods"):
        _ = session.decoder


def test_a_pair_request_names_a_config_or_two_models(pair_yaml):
    with pytest.raises(ValueError, match="not both"):
        PairRequest(pair_yaml, target=pair_yaml.parent / "target").load()
    folders = PairRequest(target=pair_yaml.parent / "target", draft=pair_yaml.parent / "draft",
                          tokenizer=SHIPPED_TOKENIZER).load()
    assert folders.fingerprint() == PairRequest(pair_yaml).load().fingerprint()
    with pytest.raises(ValueError, match="latency request"):
        LatencyRequest(" ")
