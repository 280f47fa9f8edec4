"""Hostile documents and concurrent writers: ingestion reads only regular files inside the
folder it is given, bounded in size, prints names escaped, and keeps Chroma and the
docstore consistent (one writer per index, a lost Chroma folder re-filled, a damaged
docstore reported with the repair command). Real Chroma on disk, real LlamaIndex, the real
embedding model, and a tiny random LLM (so no test here needs the default model)."""

import os
import shutil
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("llama_index.core")
pytest.importorskip("chromadb")

from ragblend.cli import main  # noqa: E402
from ragblend.core.errors import InvalidInputError  # noqa: E402
from ragblend.integrations.local_index import (  # noqa: E402
    IndexBusyError,
    IndexCorruptError,
    LocalIndex,
    path_under_root,
    printable,
    read_text_files,
)

from ..conftest import make_tiny_engine  # noqa: E402

TEXT = "The ferry to Hallow Holm leaves the north pier at {} o'clock and returns before the evening tide.\n"


def skipped(report) -> dict:
    return {os.path.basename(p): reason for p, reason in report.skipped}


@pytest.fixture
def layout(tmp_path):
    """docs/ with one real document, and outside/ with a secret next to it."""
    docs, outside = tmp_path / "docs", tmp_path / "outside"
    docs.mkdir()
    (outside / "private").mkdir(parents=True)
    (docs / "notes.md").write_text("Public notes about the lighthouse.\n")
    (outside / "secret.txt").write_text("the password is swordfish\n")
    (outside / "private" / "diary.md").write_text("dear diary, swordfish again\n")
    return docs, outside


# ---------------------------------------------------------------------------- reading files


def test_links_out_of_the_folder_are_not_followed(layout):
    docs, outside = layout
    (docs / "leak.txt").symlink_to("../outside/secret.txt")          # a file link out
    (docs / "more").symlink_to(outside / "private", target_is_directory=True)   # a folder link out
    (docs / "inner.md").symlink_to("notes.md")                       # a link inside: the same document once
    documents, report = read_text_files([docs])
    assert [d.metadata["file_name"] for d in documents] == ["inner.md"] or \
        [d.metadata["file_name"] for d in documents] == ["notes.md"]
    assert not any("swordfish" in d.text for d in documents)
    reasons = skipped(report)
    assert "outside" in reasons["leak.txt"] and "--follow-links" in reasons["leak.txt"]
    assert "outside" in reasons["more"]
    followed, _ = read_text_files([docs], follow_links=True)   # the operator's explicit choice
    assert sum("swordfish" in d.text for d in followed) == 2


def test_a_fifo_and_proc_files_are_skipped_without_hanging(layout):
    docs, _ = layout
    os.mkfifo(docs / "pipe.md")                   # reading it would block forever
    (docs / "status.txt").symlink_to("/proc/self/status")
    (docs / "zero.txt").symlink_to("/dev/zero")   # never ends
    result = {}
    worker = threading.Thread(target=lambda: result.update(out=read_text_files([docs], follow_links=True)))
    worker.start()
    worker.join(20)
    assert not worker.is_alive(), "reading the folder hung"
    documents, report = result["out"]
    assert [d.metadata["file_name"] for d in documents] == ["notes.md"]
    reasons = skipped(report)
    assert "not a regular file" in reasons["pipe.md"]
    assert "system file" in reasons["status.txt"] and "system file" in reasons["zero.txt"]
    _, report = read_text_files([docs])             # without --follow-links: links out of the folder
    assert "outside" in skipped(report)["status.txt"]


def test_an_oversized_file_is_skipped_with_its_reason(layout):
    docs, _ = layout
    (docs / "huge.md").write_bytes(b"word " * (3 * 2**20 // 5 + 1))   # just over 3 MB
    documents, report = read_text_files([docs], max_file_mb=3)
    assert [d.metadata["file_name"] for d in documents] == ["notes.md"]
    assert "over the 3 MB limit" in skipped(report)["huge.md"] and "--max-file-mb" in skipped(report)["huge.md"]
    documents, _ = read_text_files([docs], max_file_mb=4)
    assert len(documents) == 2
    with pytest.raises(InvalidInputError, match="max_file_mb"):
        read_text_files([docs], max_file_mb=0)


def test_file_names_are_printed_escaped(tmp_path, capsys):
    docs = tmp_path / "docs"
    docs.mkdir()
    hostile = "x\x1b[2J\x1b[31mred\nIngested 99 new or changed file(s)\u202e.pdf"
    (docs / hostile).write_text("not a text type")
    (docs / "empty.md").write_text("")
    assert main(["ingest", str(docs), "--index", str(tmp_path / "index")]) == 1   # nothing to ingest: no model
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\u202e" not in err
    assert "\\x1b[2J\\x1b[31mred\\nIngested 99" in err and "\\u202e" in err
    assert not any(line.startswith("Ingested") for line in err.splitlines())
    assert printable("a\tb\x00c") == "a\\tb\\x00c" and printable("café ✓") == "café ✓"


def test_path_under_root_refuses_anything_outside_it(layout, tmp_path):
    docs, outside = layout
    (docs / "leak.txt").symlink_to("../outside/secret.txt")
    (docs / "up").symlink_to("..", target_is_directory=True)
    assert path_under_root("notes.md", docs) == (docs / "notes.md").resolve()
    assert path_under_root(str(docs), docs) == docs.resolve()
    for hostile in (str(outside / "secret.txt"), "../outside/secret.txt", "leak.txt", "up", "up/outside",
                    "/etc/passwd", "/proc/self/environ", "~"):
        with pytest.raises(InvalidInputError, match="outside the folder this app may read"):
            path_under_root(hostile, docs)
    with pytest.raises(InvalidInputError, match="No such file"):
        path_under_root("missing.md", docs)
    with pytest.raises(InvalidInputError, match="NUL"):
        path_under_root("a\x00b", docs)


# ---------------------------------------------------------------------------- one index, one writer


@pytest.fixture
def tiny_index(tmp_path, tokenizer):
    """A factory of LocalIndex objects over one folder: real Chroma, docstore and embedding
    model, a tiny LLM (its KV store in the index folder)."""
    from ragblend.core.store.tiers import open_store

    def make():
        engine = make_tiny_engine("llama", tokenizer)
        engine.store = open_store(tmp_path / "index" / "kv", engine.entry_spec)
        return LocalIndex(tmp_path / "index", engine=engine)

    return make


@pytest.fixture
def six_docs(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(6):
        (docs / f"{i}.md").write_text(TEXT.format(i + 6) * 3)
    return docs


def forget_chroma_clients():
    """Chroma shares one client per folder inside a process; another process opens it afresh."""
    from chromadb.api.client import SharedSystemClient

    SharedSystemClient.clear_system_cache()


def hold_lock(index_dir, seconds):
    """Another process holding the index's writer lock, as a running ingest does."""
    code = ("import sys, time; from pathlib import Path; from ragblend.integrations.local_index import index_lock\n"
            f"with index_lock(Path({str(index_dir)!r})):\n    print('locked', flush=True); time.sleep({seconds})")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "locked"
    return child


def test_a_second_ingest_is_refused_while_another_runs_then_waits_for_it(tiny_index, six_docs, tmp_path):
    rag = tiny_index()
    child = hold_lock(rag.path, 60)
    try:
        rag.lock_wait_s = 0.3
        with pytest.raises(IndexBusyError, match=f"another ingest is running on .*index \\(pid {child.pid}\\)"):
            rag.ingest([six_docs], show_progress=False)
        assert len(rag) == 0 and not (rag.path / "docstore.json").exists()
    finally:
        child.kill()
        child.wait()
    child = hold_lock(rag.path, 1.5)
    rag.lock_wait_s = 60
    started = time.monotonic()
    report = rag.ingest([six_docs], show_progress=False)   # waits for the other writer, then runs
    assert time.monotonic() - started > 1 and child.wait(10) == 0
    assert len(report.files) == 6 and len(rag) == report.nodes == 6


def test_overlapping_ingests_take_turns_and_never_duplicate(tiny_index, six_docs):
    indexes = [tiny_index(), tiny_index()]
    errors = []

    def ingest(rag):
        try:
            rag.ingest([six_docs], show_progress=False)
        except Exception as err:   # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=ingest, args=(rag,)) for rag in indexes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert errors == []
    assert len(indexes[0]) == 6
    report = tiny_index().ingest([six_docs], show_progress=False)
    assert report.unchanged == 6 and report.nodes == 0 and len(indexes[0]) == 6


def test_nodes_the_docstore_does_not_list_are_replaced_not_duplicated(tiny_index, six_docs):
    from llama_index.core.storage.docstore import SimpleDocumentStore

    rag = tiny_index()
    rag.ingest([six_docs], show_progress=False)
    docstore_file = rag.path / "docstore.json"
    docstore = SimpleDocumentStore.from_persist_path(str(docstore_file))
    for doc_id in sorted(docstore.get_all_document_hashes().values())[:3]:   # as a lost race left it: 3 of 6
        docstore.delete_document(doc_id)
    docstore.persist(str(docstore_file))
    report = rag.ingest([six_docs], show_progress=False)
    assert report.unchanged == 3 and len(rag) == 6
    assert sorted(n.metadata["file_name"] for n in rag.vector_store.get_nodes()) == [f"{i}.md" for i in range(6)]


def test_a_deleted_chroma_folder_is_refilled_on_the_next_ingest(tiny_index, six_docs, caplog):
    rag = tiny_index()
    rag.ingest([six_docs], show_progress=False)
    del rag
    forget_chroma_clients()
    shutil.rmtree(six_docs.parent / "index" / "chroma")
    with caplog.at_level("WARNING"):
        rag = tiny_index()
    assert "holds no chunk, but its docstore lists 6 file(s)" in caplog.text
    report = rag.ingest([six_docs], show_progress=False)
    assert report.unchanged == 0 and len(rag) == 6


def test_a_truncated_docstore_is_a_clear_error_and_rebuild_repairs_it(tiny_index, six_docs):
    rag = tiny_index()
    rag.ingest([six_docs], show_progress=False)
    docstore_file = rag.path / "docstore.json"
    docstore_file.write_bytes(docstore_file.read_bytes()[: docstore_file.stat().st_size // 2])
    with pytest.raises(IndexCorruptError) as caught:
        rag.ingest([six_docs], show_progress=False)
    assert str(docstore_file) in str(caught.value) and "ragblend ingest --rebuild" in str(caught.value)
    with pytest.raises(IndexCorruptError):
        rag.delete(six_docs / "0.md")
    assert len(rag) == 6   # nothing was deleted
    rag.rebuild()
    report = rag.ingest([six_docs], show_progress=False)
    assert report.unchanged == 0 and len(report.files) == 6 and len(rag) == 6


# ---------------------------------------------------------------------------- a failed ingest's leftovers


@pytest.fixture
def tiny_model_dir(tmp_path, tokenizer):
    from ..conftest import tiny_model

    tiny_model("llama").save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    return str(tmp_path / "model")


def test_a_failed_ingest_into_a_new_index_leaves_no_index_behind(tiny_model_dir, six_docs, tmp_path, capsys,
                                                                 monkeypatch):
    """Ctrl-C while the chunks are embedded: the index folder (and the folders above it) this
    ingest created go again, so `ragblend ask` says there is no index, not that it is empty. An
    index folder that was there before keeps everything; a finished ingest keeps its index."""
    def ctrl_c(*args, **kwargs):
        raise KeyboardInterrupt
    real_ingest = LocalIndex.ingest_documents
    monkeypatch.setattr(LocalIndex, "ingest_documents", ctrl_c)
    new = tmp_path / "new" / "index"
    assert main(["ingest", str(six_docs), "--index", str(new), "--model", tiny_model_dir]) == 130
    assert "removed the index folder" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()
    assert main(["ask", "When does the ferry leave?", "--index", str(new), "--model", tiny_model_dir]) == 2
    assert "There is no index at" in capsys.readouterr().err

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("the user's own file")
    assert main(["ingest", str(six_docs), "--index", str(mine), "--model", tiny_model_dir]) == 130
    assert (mine / "notes.txt").read_text() == "the user's own file" and (mine / "chroma").is_dir()

    monkeypatch.setattr(LocalIndex, "ingest_documents", real_ingest)
    assert main(["ingest", str(six_docs), "--index", str(new), "--model", tiny_model_dir, "--kv", "skip"]) == 0
    assert (new / "chroma").is_dir()
