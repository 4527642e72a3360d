"""GGUF targets: refusing what is not a readable causal LM, and the fetched SmolLM2 file read and converted exactly.

The tests that need the real file run where ``ddte fetch smollm2`` has run (CI does, before the suite) and skip
elsewhere; the refusals use small files written here.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from decode.models.gguf import check_gguf_file, convert_gguf, load_gguf_model, load_gguf_tokenizer
from decode.models.loading import load_causal_lm
from decode.models.registry import fetched_gguf, fetched_model_dir, is_fetched

needs_smollm2 = pytest.mark.skipif(not is_fetched("smollm2") or not fetched_gguf("smollm2").is_file(),
                                   reason="run `ddte fetch smollm2` first (CI does)")


def write_gguf(path, architecture: str) -> None:
    """A GGUF file with only an architecture name and one small tensor."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_file_without_the_gguf_magic_is_refused(tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="not a GGUF file"):
        check_gguf_file(fake)
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_causal_lm(fake)


def test_a_missing_gguf_is_refused(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_causal_lm(tmp_path / "absent.gguf")


def test_an_unsupported_architecture_is_refused_in_one_line(tmp_path):
    path = tmp_path / "odd.gguf"
    write_gguf(path, "notanarch")
    with pytest.raises(ValueError, match="not supported") as err:
        load_gguf_model(path)
    assert "\n" not in str(err.value)


def test_a_failed_conversion_leaves_nothing_at_the_output(tmp_path):
    path = tmp_path / "odd.gguf"
    write_gguf(path, "notanarch")
    output = tmp_path / "out" / "hf"
    with pytest.raises(ValueError):
        convert_gguf(path, output)
    assert not output.exists()
    assert not list((tmp_path / "out").glob(".hf-*")) if (tmp_path / "out").exists() else True


@needs_smollm2
def test_a_truncated_gguf_is_refused(tmp_path):
    truncated = tmp_path / "cut.gguf"
    with fetched_gguf("smollm2").open("rb") as handle:
        truncated.write_bytes(handle.read(1 << 20))
    with pytest.raises(ValueError, match="cannot read"):
        load_gguf_model(truncated)


@needs_smollm2
def test_the_fetched_folder_holds_the_gguf_weights_exactly():
    """The converted safetensors folder and the GGUF file, read directly, give the same logits (fp32)."""
    direct = load_gguf_model(fetched_gguf("smollm2"), torch.float32)
    folder = load_causal_lm(fetched_model_dir("smollm2"), "cpu", torch.float32)
    assert type(folder).__name__ == "LlamaForCausalLM" and folder.config.num_hidden_layers == 30
    assert not hasattr(folder.config, "quantization_config")
    ids = torch.tensor([[1, 9690, 198, 2683, 359, 253]])
    with torch.no_grad():
        torch.testing.assert_close(folder(input_ids=ids).logits, direct(input_ids=ids).logits, rtol=0, atol=0)


@needs_smollm2
def test_the_gguf_tokenizer_carries_its_chat_template():
    tokenizer = load_gguf_tokenizer(fetched_gguf("smollm2"))
    assert len(tokenizer) == 49152 and tokenizer.chat_template
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
