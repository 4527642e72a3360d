"""The byte-level BPE round-trips stdlib source exactly, through tokenizers and through transformers."""

from __future__ import annotations

from data_gen import corpus
from ddte.train_pair.tokenizer import train_bpe, wrap_for_transformers

TRICKY = 'def f(x ,y):\n\treturn x . y  ,  "é€😀" \r\n\n  # trailing   \n'


def _texts(split: str, n: int) -> list[str]:
    return [f.read() for f in corpus.subset(corpus.list_corpus(), n) if f.split == split]


def test_bpe_round_trips_heldout_source_exactly(tmp_path):
    from transformers import AutoTokenizer

    tok = train_bpe(_texts("train", 4), vocab_size=400)
    wrap_for_transformers(tok, model_max_length=128).save_pretrained(tmp_path)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    assert (hf.pad_token_id, hf.bos_token_id, hf.eos_token_id) == (0, 1, 2)
    assert hf.model_max_length == 128
    for text in [*_texts("heldout", 4), TRICKY]:
        ids = hf(text).input_ids
        assert ids[0] == hf.bos_token_id  # training saw <|bos|> before every file
        assert hf.decode(ids, skip_special_tokens=True) == text
        assert hf.decode(hf.encode(text, add_special_tokens=False)) == text
        assert tok.decode(tok.encode(text, add_special_tokens=False).ids) == text


def test_bpe_training_is_deterministic():
    texts = _texts("train", 3)
    assert train_bpe(texts, 350).to_str() == train_bpe(texts, 350).to_str()
