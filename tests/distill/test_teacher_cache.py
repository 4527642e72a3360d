"""distill/teacher_cache.py: the target's responses with the laws they were sampled from, kept exactly enough to
train on (top k + log-normalisers), cached whole, and batched in line with their tokens; `ddte distill` with
``data.text=laws`` end to end on a tiny pair."""

from __future__ import annotations

import json

import pytest
import torch

from data_gen.chat_prompts import shared_data_dir
from ddte.cli import main
from decode.models.draft_vocab import DraftVocab
from distill.teacher_cache import (
    LawBatches,
    TeacherLaws,
    choose_draft_vocab,
    keep_laws,
    sample_responses,
    target_token_mass,
)
from tests.factories import chat_tokenizer, save_tiny_pair, tiny_llama

TEMPS = [0.6, 1.0]


@pytest.fixture(scope="module")
def laws():
    """A tiny target's responses to three prompts of different lengths, at two sampling temperatures."""
    target = tiny_llama(1, vocab=64, hidden=32, logit_scale=3.0)
    prompts = [[5, 9, 3], [7, 2, 11, 30, 4], [8]]
    laws = sample_responses(target, TokenIds(), prompts, [1.0, 0.6, 1.0], 6, 5, TEMPS, batch_size=2,
                            log=lambda _: None)
    return target, prompts, laws


class TokenIds:
    """All of a tokenizer that sampling token ids needs."""

    eos_token_id = 1
    pad_token_id = 0


def test_kept_laws_give_the_exact_log_probabilities_of_the_top_tokens():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0)) * 3
    ids, top, log_norm = keep_laws(logits, 6, TEMPS)
    for index, t in enumerate(TEMPS):
        expected = torch.log_softmax(logits / t, -1).gather(-1, ids.long())
        assert torch.allclose(top / t - log_norm[:, index : index + 1], expected, atol=1e-5)


def test_each_kept_law_is_the_targets_law_at_that_response_token(laws):
    """Recompute: the target's own forward over prompt + response, unpadded, gives the same laws row by row."""
    target, prompts, cached = laws
    assert len(cached) == 3 and torch.equal(cached.starts, torch.tensor([len(p) for p in prompts]))
    for j, prompt in enumerate(prompts):
        sequence = cached.sequence(j)
        assert sequence[: len(prompt)] == prompt and len(sequence) > len(prompt)
        with torch.no_grad():
            logits = target(input_ids=torch.tensor([sequence])).logits[0, len(prompt) - 1 : -1]  # (n, V)
        ids, top, log_norm = keep_laws(logits, 5, TEMPS)
        rows = cached.response_rows(j)
        assert torch.equal(cached.top_ids[rows], ids)
        assert torch.allclose(cached.top_logits[rows], top, atol=1e-4)
        assert torch.allclose(cached.log_norm[rows], log_norm, atol=1e-4)


def test_a_saved_file_loads_back_whole_and_a_corrupt_one_is_a_value_error(laws, tmp_path):
    _, _, cached = laws
    path = tmp_path / "laws.safetensors"
    cached.save(path)
    again = TeacherLaws.load(path)
    assert again.temperatures == TEMPS and torch.equal(again.top_ids, cached.top_ids)
    assert torch.equal(again.tokens, cached.tokens) and torch.equal(again.offsets, cached.offsets)
    assert [p.name for p in tmp_path.iterdir()] == ["laws.safetensors"]
    path.write_bytes(b"garbage")
    with pytest.raises(ValueError, match="unreadable teacher laws"):
        TeacherLaws.load(path)


@pytest.mark.parametrize("max_len", [64, 4])
def test_batches_put_each_law_at_the_position_that_predicts_its_token(laws, max_len):
    """Position s of a batch predicts token s + 1: where masked, it holds that token's law; a cut to the last
    ``max_len`` tokens keeps the laws of the tokens that remain."""
    _, _, cached = laws
    batch = LawBatches(cached, 3, max_len, seed=0).batch([0, 1, 2])
    for b in range(3):
        rows = cached.response_rows(b)
        sequence = cached.sequence(b)
        kept = min(len(sequence), max_len)
        assert batch.ids[b, :kept].tolist() == sequence[-kept:]
        positions = batch.mask[b].nonzero().flatten()
        n = min(rows.stop - rows.start, kept - 1)
        assert positions.numel() == n
        expected = cached.top_logits[rows][-n:] / 1.0 - cached.log_norm[rows][-n:, 1:2]
        assert torch.allclose(batch.log_p_top[1, b, positions], expected, atol=1e-6)


needs_data = pytest.mark.skipif(not shared_data_dir().is_dir(), reason="../shared/data is not beside the checkout")


@needs_data
def test_distill_on_cached_laws_end_to_end(tmp_path):
    root = save_tiny_pair(tmp_path / "pair", target_hidden=32, draft_hidden=16, logit_scale=4.0, context=512)
    chat_tokenizer().save_pretrained(tmp_path / "tokenizer")
    overrides = {
        "target": root / "target", "draft": root / "draft", "tokenizer": tmp_path / "tokenizer",
        "output": tmp_path / "out", "tracking.tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
        "teacher_topk": 8, "data.text": "laws", "data.responses": 3, "data.response_tokens": 6,
        "data.cache_dir": tmp_path / "cache", "data.seq_len": 64, "data.batch_size": 4, "data.val_blocks": 2,
        "train.steps": 6, "train.val_every": 6, "train.warmup_steps": 1, "train.threads": 1,
    }
    argv = ["distill", "--no-progress", *[f"{k}={v}" for k, v in overrides.items()]]
    assert main(argv) == 0
    summary = json.loads((tmp_path / "out" / "distill.json").read_text())
    assert summary["text"]["text"] == "laws" and summary["text"]["sequences"] == 6  # 3 prompts x 2 temperatures
    assert summary["text"]["response_tokens"] >= 6 and summary["steps"] == 6
    (cache,) = (tmp_path / "cache").glob("laws-*.safetensors")
    stamp = cache.stat().st_mtime_ns
    assert main([*argv, "overwrite=true"]) == 0  # the second run reads the cache
    assert cache.stat().st_mtime_ns == stamp


def test_the_draft_vocabulary_holds_the_tokens_of_largest_target_mass(laws):
    _, _, cached = laws
    mass = target_token_mass(cached, 64)
    assert float(mass.sum()) <= cached.response_token_count() + 1e-4  # each law's top k holds at most 1
    vocab = choose_draft_vocab(cached, 64, 8, always=[1])
    outside = torch.ones(64, dtype=torch.bool)
    outside[vocab.token_ids] = False
    assert 1 in vocab.token_ids.tolist() and float(mass[outside].max()) <= float(mass[vocab.token_ids].max())
    assert 0 < vocab.info["target_mass_covered"] <= 1


def test_draft_vocab_command_writes_the_set_beside_the_draft(laws, tmp_path, capsys):
    _, _, cached = laws
    cached.save(tmp_path / "laws.safetensors")
    tiny_llama(2, vocab=64, hidden=16).save_pretrained(tmp_path / "draft")
    argv = ["draft-vocab", "--draft", str(tmp_path / "draft"), "--size", "8"]
    assert main([*argv, "--laws", str(tmp_path / "laws.safetensors")]) == 0
    vocab = DraftVocab.load(tmp_path / "draft")
    assert vocab.vocab_size == 64 and 8 <= vocab.size <= 9 and "holding" in capsys.readouterr().out
    assert main(argv) == 2  # no --laws, and the draft's folder names none
    assert main([*argv, "--laws", str(tmp_path / "nothing.safetensors")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "give --laws" in err[0] and "no cached laws" in err[1]


@pytest.mark.parametrize("draft_vocab", [32, 128])
def test_laws_of_a_target_with_another_vocabulary_are_refused(laws, tmp_path, capsys, draft_vocab):
    """Laws of a 64-token target beside a draft of 32 tokens (ids beyond it) or 128 (the recorded V differs)."""
    _, _, cached = laws
    assert cached.vocab_size == 64  # recorded when sampled, and kept through the file
    cached.save(tmp_path / "laws.safetensors")
    tiny_llama(2, vocab=draft_vocab, hidden=16).save_pretrained(tmp_path / "draft")
    argv = ["draft-vocab", "--draft", str(tmp_path / "draft"), "--size", "8", "--laws",
            str(tmp_path / "laws.safetensors")]
    assert main(argv) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("ddte ")]  # not the save's bars
    assert len(err) == 1 and f"64 tokens; this draft's vocabulary has {draft_vocab}" in err[0]
    assert not (tmp_path / "draft" / "draft_vocab.safetensors").exists()


def test_laws_of_an_older_ddte_say_what_is_not_checked(laws, tmp_path, capsys):
    """A laws file without a recorded V (written before it was recorded) runs, with a note saying so."""
    import dataclasses

    _, _, cached = laws
    dataclasses.replace(cached, vocab_size=0).save(tmp_path / "old.safetensors")
    tiny_llama(2, vocab=64, hidden=16).save_pretrained(tmp_path / "draft")
    assert main(["draft-vocab", "--draft", str(tmp_path / "draft"), "--size", "8", "--laws",
                 str(tmp_path / "old.safetensors")]) == 0
    assert "records no vocabulary size" in capsys.readouterr().err
