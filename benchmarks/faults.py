"""Fault injection on the real model: every store fault and bad input of issue 13, at scale.

    python -m benchmarks.faults                    # SmolLM2, 20 random SIGKILLs (~3 min, 2 cores)
    python -m benchmarks.faults --kills 50 --out docs

Each fault gets a fresh KV store (the sample chunks precomputed) in a sandbox folder beside an
"outside" folder of sentinel files. A fault is *survived* when the answer equals the clean
run's (first-token logits within 1e-4 and the same greedy answer), the query finished within
``--bound`` seconds, no file outside the store changed, and no entry file is left that no
database row names. Faults that need root (tmpfs, bind mounts) are reported as skipped
without it. A bad input *gets a clear error* when it raises a ``RagblendError`` (CLI: exit 2
with a ``ragblend: error:`` line) and stores nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import random
import shutil
import signal
import sqlite3
import struct
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from ragblend import BlendEngine, Chunk, RagblendError
from ragblend.core.store import MAGIC, DiskStore, MemoryStore, TieredStore, open_store
from ragblend.data import load_sample

from .models import MODELS, model_path
from .run import command_line, write_report

GREEDY_TOKENS = 24


# ---------------------------------------------------------------------------- the sandbox


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` with a hash of its bytes."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and not p.is_symlink()}


def unnamed_entry_files(folder: Path) -> int:
    """Entry files no database row names (leaks)."""
    with contextlib.closing(sqlite3.connect(f"file:{folder / 'cache.db'}?mode=ro", uri=True)) as db:
        named = {row[0] for row in db.execute("SELECT filename FROM Cache")}
    return len({str(p.relative_to(folder)) for p in folder.rglob("*.val")} - named)


def unnamed_after_reopening(store, folder: Path, spec) -> int | str:
    """Entry files no row names once the store is opened again (as the next process would,
    with no writer left, so every such file is a leftover); "n/a" without a readable store."""
    if isinstance(store, TieredStore):
        store.disk.close()
        folder = store.disk.directory
    if not folder.is_dir():
        return 0   # the folder is gone and nothing re-created it
    try:
        DiskStore(folder, spec, orphan_age_s=0).close()
    except Exception:
        return "n/a"
    return unnamed_entry_files(folder)


def bounded(fn, seconds: float):
    """``fn()``'s result, or raise TimeoutError when it takes longer than ``seconds`` (a hang)."""
    result: dict = {}

    def call():
        try:
            result["value"] = fn()
        except BaseException as err:  # reported, not swallowed
            result["error"] = err

    worker = threading.Thread(target=call, daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        raise TimeoutError(f"still running after {seconds:.0f} s")
    if "error" in result:
        raise result["error"]
    return result["value"]


def root_mount(*args) -> str | None:
    """Run ``mount``; the reason it failed, or None."""
    done = subprocess.run(["mount", *args], capture_output=True, text=True)
    return done.stderr.strip() or "mount failed" if done.returncode else None


class Skip(Exception):
    """This machine cannot make the fault (e.g. mounting needs root)."""


# ---------------------------------------------------------------------------- faults


@dataclass
class Scene:
    """One fault's world: the engine (memory tier off, disk tier in ``box/kv`` holding the
    chunks) and the sandbox, with ``box/outside/precious.txt`` the file nothing may touch."""

    engine: BlendEngine
    box: Path
    chunks: list[str]
    model: str | None

    @property
    def disk(self) -> DiskStore:
        return self.engine.store.disk

    def victim_file(self) -> Path:
        """The entry file of the first chunk."""
        key = self.engine.key_of(self.chunks[0])
        (filename,) = self.disk.cache._sql("SELECT filename FROM Cache WHERE key = ?", (key,)).fetchone()
        return self.disk.directory / filename

    def reopen(self, folder: Path | None = None) -> None:
        """Open the store again, as the next process would (memory tier off)."""
        self.disk.close()
        self.engine.store = open_store(folder or self.box / "kv", self.engine.entry_spec, memory_bytes=0)

    def reopen_after_writers_died(self) -> None:
        """Open the store again when no writer is alive, so any unnamed file is a leftover."""
        self.disk.close()
        self.engine.store = TieredStore(MemoryStore(0), DiskStore(self.box / "kv", self.engine.entry_spec,
                                                                  orphan_age_s=0))


# Each fault makes its damage in a scene and returns None or a callable that lifts it (ends
# the lock, frees the disk, unmounts the read-only view) and keeps the store's files, so
# that leftovers can be counted after it.


def row_points_outside(scene: Scene, relative: bool):
    target = "../outside/precious.txt" if relative else str(scene.box / "outside" / "precious.txt")
    victim = scene.victim_file().relative_to(scene.disk.directory).as_posix()
    scene.disk.cache._sql("UPDATE Cache SET filename = ? WHERE filename = ?", (target, victim))


def special_file(scene: Scene, kind: str):
    path = scene.victim_file()
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to(scene.box / "outside" / "precious.txt")


def corrupt(scene: Scene, how: str):
    path = scene.victim_file()
    blob = bytearray(path.read_bytes())
    if how == "truncated":
        blob = blob[: len(blob) // 2]
    else:
        blob[-10] ^= 0xFF
    path.write_bytes(bytes(blob))


def hostile_header(scene: Scene, edit):
    """Replace the victim's header by ``edit(real header)`` (bytes or a dict), with a valid CRC."""
    path = scene.victim_file()
    blob = path.read_bytes()
    (length,) = struct.unpack("<I", blob[4:8])
    header = edit(json.loads(blob[8:8 + length]))
    header = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(MAGIC + struct.pack("<I", len(header)) + header + struct.pack("<I", zlib.crc32(header))
                     + blob[12 + length:])


def locked_database(scene: Scene):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sqlite3, sys, time\n"
         f"c = sqlite3.connect({str(scene.box / 'kv' / 'cache.db')!r}, isolation_level=None)\n"
         "c.execute('BEGIN EXCLUSIVE'); print('locked', flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE, text=True)
    holder.stdout.readline()
    return lambda: (holder.kill(), holder.wait())


def locked_at_open(scene: Scene):
    lift = locked_database(scene)
    scene.reopen()   # diskcache alone would retry for 60 s
    return lift


def folder_deleted(scene: Scene):
    shutil.rmtree(scene.box / "kv")


def garbage_database(scene: Scene):
    scene.disk.close()
    (scene.box / "kv" / "cache.db").write_bytes(b"this is not a database" * 100)
    scene.reopen()


def full_disk(scene: Scene):
    small = scene.box / "small"
    small.mkdir()
    if (why := root_mount("-t", "tmpfs", "-o", "size=4m", "tmpfs", str(small))):
        raise Skip(why)
    scene.reopen(small / "kv")
    scene.engine.precompute(scene.chunks[:2])
    with open(small / "filler", "wb") as out, contextlib.suppress(OSError):
        while True:
            out.write(b"\0" * (1 << 16))
            out.flush()
    return (small / "filler").unlink   # the tmpfs itself is unmounted with the sandbox


def read_only(scene: Scene, while_open: bool):
    folder = scene.box / "kv"
    if (why := root_mount("--bind", str(folder), str(folder))) or (
            why := root_mount("-o", "remount,bind,ro", str(folder))):
        raise Skip(why)
    if not while_open:
        scene.reopen()
    return lambda: subprocess.run(["umount", "-l", str(folder)], check=False)


KILLED_WRITER = """
import sys
from ragblend import BlendEngine
from ragblend.core.store import DiskStore
engine = BlendEngine.from_pretrained(sys.argv[1] or None, kv_dir=False)
engine.store = DiskStore(sys.argv[2], engine.entry_spec)
print("ready", flush=True)
for i in range(10**6):
    engine.precompute([f"Entry {i} of a writer that is about to be killed. " * 30])
"""


def killed_writers(scene: Scene, kills: int):
    """SIGKILL writers at random moments, then reopen the store as a new process would."""
    rng = random.Random(0)
    for _ in range(kills):
        proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, scene.model or "", str(scene.box / "kv")],
                                stdout=subprocess.PIPE, text=True)
        proc.stdout.readline()
        time.sleep(rng.uniform(0.05, 1.0))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    scene.reopen_after_writers_died()
    unsound = [key for key in scene.disk.keys() if scene.disk.verify(key) is not None]
    if unsound:
        raise AssertionError(f"{len(unsound)} entries failed verification after the kills")


def faults(kills: int) -> dict:
    def first_token_id(value):
        return lambda real: {**real, "token_ids": [value] + real["token_ids"][1:]}

    return {
        "a cache.db row naming an absolute path outside the store": lambda s: row_points_outside(s, False),
        "a cache.db row naming ../outside": lambda s: row_points_outside(s, True),
        "an entry file replaced by a FIFO": lambda s: special_file(s, "fifo"),
        "an entry file replaced by a symlink to an outside file": lambda s: special_file(s, "symlink"),
        "a truncated entry": lambda s: corrupt(s, "truncated"),
        "a flipped bit in a layer": lambda s: corrupt(s, "bit"),
        "a header of 200k nested arrays (valid CRC)": lambda s: hostile_header(
            s, lambda real: b'{"token_ids": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"),
        "a header with token id 10**30 (valid CRC)": lambda s: hostile_header(s, first_token_id(10**30)),
        "a header with a token id past the vocabulary (valid CRC)": lambda s: hostile_header(s, first_token_id(10**7)),
        "a header with nested lists as token ids (valid CRC)": lambda s: hostile_header(
            s, lambda real: {**real, "token_ids": [[i] for i in real["token_ids"]]}),
        "another process holding a SQLite write lock": locked_database,
        "another process holding the write lock when the store opens": locked_at_open,
        "the KV folder deleted while running": folder_deleted,
        "a garbage cache.db": garbage_database,
        "a full disk (4 MiB tmpfs)": full_disk,
        "a read-only KV folder (bind mount)": lambda s: read_only(s, while_open=False),
        "the KV folder becoming read-only while running": lambda s: read_only(s, while_open=True),
        f"{kills} writers SIGKILLed at random points": lambda s: killed_writers(s, kills),
    }


# ---------------------------------------------------------------------------- bad inputs


def bad_inputs(engine, chunk: str) -> dict:
    from ragblend.cli import main as cli

    def cli_call(*argv):
        def run():
            err = io.StringIO()
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                try:
                    code = cli(list(argv))
                except SystemExit as exit:
                    code = exit.code
            if code != 2 or "error" not in err.getvalue():
                raise AssertionError(f"exit {code}: {err.getvalue()[-200:]}")
            return err.getvalue().strip().splitlines()[-1]
        return run

    return {
        "a lone surrogate in a chunk": lambda: Chunk("caf\udce9"),
        "a lone surrogate in a segment": lambda: engine.generate(["caf\udce9?"], max_new_tokens=1),
        "a lone surrogate in system": lambda: engine.generate(["Hi"], system="\udce9", max_new_tokens=1),
        "a lone surrogate in find_chunks": lambda: engine.find_chunks("\udce9"),
        "temperature=nan": lambda: engine.generate([Chunk(chunk), "Q?"], temperature=float("nan")),
        "top_p=inf": lambda: engine.generate([Chunk(chunk), "Q?"], top_p=float("inf")),
        'seed="abc"': lambda: engine.generate([Chunk(chunk), "Q?"], temperature=1.0, seed="abc"),
        "seed=1.5": lambda: engine.generate([Chunk(chunk), "Q?"], temperature=1.0, seed=1.5),
        "seed=2**70": lambda: engine.generate([Chunk(chunk), "Q?"], temperature=1.0, seed=2**70),
        "system=123": lambda: engine.generate(["Hi"], system=123),
        "precompute(None)": lambda: engine.precompute(None),
        'Chunk("")': lambda: Chunk(""),
        "memory_bytes=-1": lambda: MemoryStore(-1),
        "a prompt longer than the context window": lambda: engine.prefill(["word " * 10_000]),
        "ragblend ask --top-k 0": cli_call("ask", "q", "--top-k", "0"),
        "ragblend ask --max-new-tokens 0": cli_call("ask", "q", "--max-new-tokens", "0"),
        "ragblend ask with a non-UTF-8 question": cli_call("ask", "caf\udce9?"),
        "ragblend cache stats --kv-dir <a file>": cli_call("cache", "stats", "--kv-dir", __file__),
    }


# ---------------------------------------------------------------------------- the run


def answer(engine, segments) -> tuple[torch.Tensor, str]:
    out = engine.generate(segments, max_new_tokens=GREEDY_TOKENS)
    return out.logits, out.text


def run_fault(scene: Scene, make, segments, clean, bound: float) -> dict:
    engine, box = scene.engine, scene.box
    (box / "outside").mkdir()
    (box / "outside" / "precious.txt").write_text("keep me")
    engine.store = TieredStore(MemoryStore(0), DiskStore(box / "kv", engine.entry_spec))
    engine.precompute(scene.chunks)
    lift, row = None, {}
    try:
        outside = snapshot(box / "outside")
        lift = make(scene)
        t0 = time.perf_counter()
        logits, text = bounded(lambda: answer(engine, segments), bound)
        engine.flush()
        row["seconds"] = time.perf_counter() - t0
        if lift:
            lift, release = None, lift
            release()
        row["same answer"] = bool((logits - clean[0]).abs().max() <= 1e-4 and text == clean[1])
        row["outside touched"] = snapshot(box / "outside") != outside
        row["unnamed files"] = unnamed_after_reopening(engine.store, box / "kv", engine.entry_spec)
        row["store faults"] = engine.store.faults
        row["survived"] = row["same answer"] and not row["outside touched"] and row["unnamed files"] in (0, "n/a")
    except Skip as why:
        row["skipped"] = str(why)
    except BaseException as err:  # a crash or a hang is the finding
        row["survived"], row["error"] = False, f"{type(err).__name__}: {err}"[:200]
    finally:
        if lift:   # the query failed before the fault was lifted
            with contextlib.suppress(Exception):
                lift()
        with contextlib.suppress(Exception):
            engine.store.disk.close()
        for folder in (box / "kv", box / "small"):
            if os.path.ismount(folder):
                subprocess.run(["umount", "-l", str(folder)], check=False)
        shutil.rmtree(box, ignore_errors=True)
    return row


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=MODELS, default="smollm2")
    parser.add_argument("--kills", type=int, default=20, help="writers SIGKILLed at random points")
    parser.add_argument("--bound", type=float, default=30.0, help="seconds after which a query counts as hung")
    parser.add_argument("--out", default=None, help="also write faults-run.md into this folder")
    args = parser.parse_args(argv)
    t_start = time.perf_counter()

    model = model_path(args.model)
    engine = BlendEngine.from_pretrained(model, kv_dir=False)
    sample = load_sample()
    chunks = sample["chunks"][:4]
    segments = [Chunk(c) for c in chunks] + [sample["question"]]
    clean = answer(engine, segments)

    lines = ["| fault | survived | same answer | files touched outside | unnamed files after reopening | store faults | "
             "query + flush s |", "|---|---|---|---|---|---|---:|"]
    survived = tried = skipped = 0
    for name, make in faults(args.kills).items():
        scene = Scene(engine, Path(tempfile.mkdtemp(prefix="ragblend-fault-")), chunks, model)
        row = run_fault(scene, make, segments, clean, args.bound)
        skipped += "skipped" in row
        if "skipped" in row:
            lines.append(f"| {name} | skipped: {row['skipped']} | | | | | |")
        elif "error" in row:
            tried += 1
            lines.append(f"| {name} | **no**: {row['error']} | | | | | |")
        else:
            tried += 1
            survived += row["survived"]
            lines.append(f"| {name} | {'yes' if row['survived'] else '**no**'} | {row['same answer']} | "
                         f"{row['outside touched']} | {row['unnamed files']} | {row['store faults']} | "
                         f"{row['seconds']:.2f} |")
        print(lines[-1], flush=True)

    engine.store = MemoryStore()
    lines += ["", "| bad input | clear ragblend error | message |", "|---|---|---|"]
    clear = 0
    inputs = bad_inputs(engine, chunks[0])
    for name, call in inputs.items():
        try:
            message = bounded(call, args.bound)
            ok = isinstance(message, str)  # the CLI cases return their error line
        except RagblendError as err:
            ok, message = True, f"{type(err).__name__}: {err}"
        except BaseException as err:
            ok, message = False, f"{type(err).__name__}: {err}"
        clear += ok
        lines.append(f"| {name} | {'yes' if ok else '**no**'} | {message[:150].replace('|', '/')} |")
        print(lines[-1], flush=True)
    summary = (f"Faults survived: {survived}/{tried} (skipped for lack of root: {skipped}); "
               f"bad inputs with a clear error: {clear}/{len(inputs)}.")
    lines += ["", summary]
    print(summary)
    if args.out:
        write_report(args.out, "faults-run.md", "Fault injection", command_line("benchmarks.faults", argv),
                     time.perf_counter() - t_start, lines)


if __name__ == "__main__":
    main()
