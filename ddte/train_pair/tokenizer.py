"""The pair's tokenizer: a byte-level BPE trained on the training split of the stdlib corpus.

Byte-level BPE is lossless on any text: ``decode(encode(x, add_special_tokens=False)) == x``. Encoding with the
default ``add_special_tokens=True`` prepends ``<|bos|>`` (as training did for every file), which
``decode(..., skip_special_tokens=True)`` drops again.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"
SPECIAL_TOKENS = [PAD, BOS, EOS]  # ids 0, 1, 2
BYTE_ALPHABET = 256  # every byte is a token of its own: the smallest vocabulary is these and the special tokens


def train_bpe(texts: Iterable[str], vocab_size: int, min_frequency: int = 2) -> Tokenizer:
    """Train a byte-level BPE on ``texts`` (in the given order, which keeps training deterministic)."""
    tok = Tokenizer(models.BPE())
    # No prefix space and no normaliser: the text is kept byte for byte, so decoding is exact.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, bos_id)])
    return tok


def wrap_for_transformers(tok: Tokenizer, model_max_length: int):
    """A ``PreTrainedTokenizerFast`` (``TokenizersBackend`` in transformers 5) around ``tok``.

    ``clean_up_tokenization_spaces`` is off because it rewrites " ." to "." and would break the exact round trip.
    """
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
