"""decode/models/draft_vocab.py: the reduced output vocabulary's file contract, its head, and decoding with it."""

from __future__ import annotations

import pytest
import torch

from decode.drafting.actions import Action
from decode.drafting.rng import TorchRandom
from decode.drafting.sampling import SamplingConfig
from decode.engine import SpeculativeDecoder
from decode.models.draft_vocab import FILE, DraftVocab, SubsetHead, attach_draft_vocab, most_frequent
from decode.pair import load_pair
from decode.policies.base import StaticPolicy
from decode.verifiers import get_verifier
from tests.factories import save_tiny_pair, tiny_llama

IDS = torch.tensor([0, 1, 3, 8, 9, 20, 41, 63])


def test_save_and_load_round_trip(tmp_path):
    vocab = DraftVocab(IDS, 64, {"source": "test", "mass": 0.9})
    vocab.save(tmp_path)
    again = DraftVocab.load(tmp_path)
    assert torch.equal(again.token_ids, IDS) and again.vocab_size == 64 and again.info == vocab.info
    assert [p.name for p in tmp_path.iterdir()] == [FILE]  # nothing staged left behind


def test_a_folder_without_the_file_has_no_draft_vocabulary(tmp_path):
    assert DraftVocab.load(tmp_path) is None


def test_a_corrupt_file_is_a_value_error(tmp_path):
    (tmp_path / FILE).write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="unreadable draft vocabulary"):
        DraftVocab.load(tmp_path)


@pytest.mark.parametrize("ids", [[3, 1], [1, 1], [-1, 2], [2, 64], []])
def test_bad_token_ids_are_refused(ids):
    with pytest.raises(ValueError, match="draft vocabulary"):
        DraftVocab(torch.tensor(ids, dtype=torch.long), 64)


def test_most_frequent_keeps_the_largest_counts_and_the_forced_tokens():
    counts = torch.tensor([5.0, 0.0, 9.0, 1.0, 9.0, 0.0])
    vocab = most_frequent(counts, 3, always=[1])
    assert vocab.token_ids.tolist() == [0, 1, 2, 4]
    with pytest.raises(ValueError, match="size"):
        most_frequent(counts, 7)


def test_the_subset_head_keeps_the_logits_of_its_tokens_and_masks_the_rest():
    model = tiny_llama(seed=3, vocab=64)
    ids = torch.tensor([[5, 9, 3, 17]])
    with torch.no_grad():
        full = model(input_ids=ids).logits[0]  # (4, 64)
        attach_draft_vocab(model, DraftVocab(IDS, 64))
        reduced = model(input_ids=ids).logits[0]
    assert isinstance(model.get_output_embeddings(), SubsetHead)
    assert torch.allclose(reduced[:, IDS], full[:, IDS], atol=1e-6)
    outside = torch.ones(64, dtype=torch.bool)
    outside[IDS] = False
    assert bool(torch.isneginf(reduced[:, outside]).all())


def test_a_head_of_another_width_is_refused():
    with pytest.raises(ValueError, match="over 32 tokens"):
        attach_draft_vocab(tiny_llama(seed=3, vocab=64), DraftVocab(IDS[:4], 32))


@pytest.fixture(scope="module")
def reduced_pair(tmp_path_factory):
    """A saved tiny pair whose draft folder carries a draft vocabulary of 1,024 of the 4,096 tokens."""
    root = save_tiny_pair(tmp_path_factory.mktemp("reduced"), target_hidden=64, draft_hidden=32, logit_scale=8.0)
    ids = torch.arange(0, 4096, 4)
    DraftVocab(ids, 4096).save(root / "draft")
    return root, ids


@pytest.mark.parametrize("fast", [True, False])
def test_the_loaded_draft_proposes_only_its_vocabulary(reduced_pair, fast):
    root, ids = reduced_pair
    pair = load_pair(root / "target", root / "draft", fast_draft=fast)
    logits = pair.draft.prefill([5, 9, 3, 17])  # (4, V) through the fast forward or HF's
    outside = torch.ones(4096, dtype=torch.bool)
    outside[ids] = False
    assert bool(torch.isneginf(logits[:, outside]).all()) and bool(torch.isfinite(logits[:, ids]).all())


@pytest.mark.parametrize("name", ["traversal", "specinfer"])
def test_greedy_output_with_a_reduced_draft_equals_the_targets_greedy(reduced_pair, name):
    root, _ = reduced_pair
    pair = load_pair(root / "target", root / "draft")
    prompt = [5, 9, 3, 17, 22]
    reference = pair.target.model.generate(torch.tensor([prompt]), max_new_tokens=20, min_new_tokens=20,
                                           do_sample=False)[0, len(prompt):].tolist()
    decoder = SpeculativeDecoder(pair.target, pair.draft, get_verifier(name))
    gen = decoder.generate(prompt, 20, StaticPolicy(Action(2, 1, 2)), TorchRandom(0), SamplingConfig(0.0))
    assert gen.tokens == reference
