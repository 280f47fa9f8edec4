"""The decoding twin's low-bit weights, kept on disk so that later processes do not build them again.

A float32 model loaded from a GGUF file decodes on 4-bit and 8-bit copies of its weights
(:mod:`.decode_weights`). Building them -- finding which weights lie on the 4-bit grid, packing
them for PyTorch's kernel, rounding the LM head to 8 bits -- took ~0.9 s of SmolLM2's ~4 s warm
start on a quiet 2-core host, every process. So the first process writes what it built to
``<cache>/decoding/<key>.safetensors`` and later ones read it (~0.1 s).

The key covers what the packed bytes depend on: the GGUF file (path, inode, size, modification
and change times), the CPU and torch version (PyTorch's 4-bit layout differs between AVX-512,
AVX2 and plain builds), a hash of the code that makes them, and ``decode_dtype``. Only
tensors are stored (safetensors: nothing is unpickled), with a CRC-32 of their bytes; a file
that cannot be read, fails its checksum or does not hold every layer it names is a miss: the weights are built again, as if nothing was cached.

A new key (another torch, a change to the code, the file replaced) leaves the old file behind, so
the folder is kept under :data:`MAX_FOLDER_BYTES`: after each write, the files read least
recently go first (a read marks its file used), never the one just written, and the budget is
never under twice that file's size.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import zlib
from pathlib import Path

import torch

from ..paths import cache_dir
from .kernels import host_key

log = logging.getLogger("ragblend")

FORMAT_VERSION = 1
# Per linear layer ``name``: ``name|kind`` (one of KINDS, as a 0-d tensor of its index) and the
# kind's tensors, ``name|<tensor>``.
KINDS = ("none", "int4", "int8", "int8head")
# The decoding folder's budget: SmolLM2's file is ~95 MB, an 8B model's would be ~4.5 GB.
MAX_FOLDER_BYTES = 6 << 30


def cache_path(hf_model, decode_dtype: str) -> Path | None:
    """Where ``hf_model``'s decoding weights are cached, or None (a model not read from a file)."""
    stamp = getattr(hf_model, "ragblend_source", None)   # set by model.load_model for a GGUF file
    if stamp is None:
        return None
    host = host_key([])   # PyTorch packs 4-bit weights differently per CPU capability (AVX-512, AVX2, ...)
    key = json.dumps({"source": stamp, "decode_dtype": decode_dtype, "format": FORMAT_VERSION,
                      "code": _code_version(), **{k: host[k] for k in ("cpu", "cpu_flags", "capability",
                                                                          "isa_settings", "torch")}}, sort_keys=True)
    return cache_dir() / "decoding" / (hashlib.sha256(key.encode()).hexdigest()[:24] + ".safetensors")


@functools.cache
def _code_version() -> str:
    """A hash of the code that decides and makes the low-bit weights: a change to it is a miss."""
    import inspect

    from . import linear

    parts = [inspect.getsource(f) for f in (linear.quantize_int4, linear.int4_error, linear.on_int4_grid,
                                             linear.quantize_int8, linear.Int4Linear, linear.Int8Linear)]
    return hashlib.sha256(("".join(parts) + repr(linear.EXACT_INT4)).encode()).hexdigest()[:16]


def checksum(tensors: dict[str, torch.Tensor]) -> str:
    """CRC-32 of the tensors' bytes, in name order (written beside them, checked on reading)."""
    crc = 0
    for name in sorted(tensors):
        crc = zlib.crc32(name.encode(), crc)
        crc = zlib.crc32(tensors[name].contiguous().reshape(-1).view(torch.uint8).numpy(), crc)
    return f"{crc:08x}"


def read(path: Path | None) -> dict[str, torch.Tensor] | None:
    """The cached tensors, or None where there are none or they cannot be read or fail their
    checksum (logged): a damaged file is a miss, never weights to decode on."""
    if path is None or not path.is_file() or path.is_symlink():
        return None
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as file:
            expected = (file.metadata() or {}).get("crc32")
            # Copied into PyTorch's own (64-byte aligned) memory: the low-bit kernels crashed on
            # tensors read in place from the file, whose offsets only safetensors' 8-byte alignment holds.
            tensors = {name: file.get_tensor(name).clone() for name in file.keys()}
        found = checksum(tensors)
    except Exception as err:   # a cache: an unreadable file is a miss
        log.warning("ragblend: could not read the cached decoding weights %s (%s: %s); building them again.",
                    path.name, type(err).__name__, err)
        return None
    if found != expected:
        log.warning("ragblend: could not read the cached decoding weights %s (their checksum is %s, the file "
                    "says %s); building them again.", path.name, found, expected)
        return None
    with contextlib.suppress(OSError):   # marks it used, for the folder's eviction
        os.utime(path)
    return tensors


def write(path: Path | None, tensors: dict[str, torch.Tensor]) -> None:
    """Store ``tensors`` at ``path`` with their checksum (written whole, then renamed into place);
    failures are logged."""
    if path is None:
        return
    try:
        from safetensors.torch import save_file

        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            tensors = {name: t.contiguous() for name, t in tensors.items()}
            save_file(tensors, str(partial), metadata={"crc32": checksum(tensors)})
            os.replace(partial, path)
        finally:
            partial.unlink(missing_ok=True)
    except Exception as err:
        log.warning("ragblend: could not cache the decoding weights (%s: %s); the next process builds them "
                    "again.", type(err).__name__, err)
        return
    try:
        # room for two models of the one just written, whatever the budget: two 8B models used in
        # turn must not evict each other's weights on every start
        evict_beyond(path.parent, max(MAX_FOLDER_BYTES, 2 * path.stat().st_size), keep=path)
    except OSError as err:   # a cache: a folder that cannot be tidied is left as it is
        log.warning("ragblend: could not tidy the decoding weights folder (%s: %s).", type(err).__name__, err)


def evict_beyond(folder: Path, max_bytes: int, keep: Path) -> None:
    """Delete the least recently used cached files in ``folder`` until the rest fit in
    ``max_bytes`` (``keep`` stays, whatever its size). Only regular files this module names
    (``*.safetensors``) are considered; a file another process removes first is skipped."""
    files = []
    for entry in os.scandir(folder):
        if entry.name.endswith(".safetensors") and entry.is_file(follow_symlinks=False):
            with contextlib.suppress(OSError):
                stat = entry.stat(follow_symlinks=False)
                files.append((stat.st_mtime, stat.st_size, Path(entry.path)))
    total = sum(size for _, size, _ in files)
    for _, size, file in sorted(files):   # least recently used first
        if total <= max_bytes:
            break
        if file == keep:
            continue
        try:
            file.unlink()
            total -= size
            log.info("ragblend: removed the cached decoding weights %s (least recently used; the folder "
                     "keeps under %d MB).", file.name, max_bytes >> 20)
        except OSError:
            pass


def by_layer(tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """The file's tensors by layer name, then by part (``"kind"``, ``"packed"``...)."""
    layers: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        name, _, part = key.partition("|")
        layers.setdefault(name, {})[part] = tensor
    return layers


def kind_of(parts: dict[str, torch.Tensor]) -> str | None:
    """The kind stored for a layer (its :func:`by_layer` parts), or None if the file does not say."""
    code = parts.get("kind")
    if code is None or code.numel() != 1 or not 0 <= int(code) < len(KINDS):
        return None
    return KINDS[int(code)]


def kind_tensor(kind: str) -> torch.Tensor:
    return torch.tensor(KINDS.index(kind), dtype=torch.int8)
