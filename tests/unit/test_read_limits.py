"""Files that cost more than they weigh (issue 58): a DOCX zip bomb, overlapping zip entries, a
PDF whose 2,000 pages draw one huge content stream. Each is skipped with its reason, within 2x
the memory and 10 s of a normal file of its size (measured in a subprocess: its peak RSS and
time); the limits (ReadLimits) are each checked, and uploads are read without touching disk."""

import json
import os
import re
import subprocess
import sys
import textwrap
import time
import zipfile

import pytest

pytest.importorskip("llama_index.core")
pytest.importorskip("pypdf")

from ragblend.cli import main  # noqa: E402
from ragblend.core.errors import InvalidInputError  # noqa: E402
from ragblend.integrations.local_index import read_text_files, read_uploads  # noqa: E402
from ragblend.integrations.readers import OverLimitError, ReadLimits, UnreadableFileError, extract_text  # noqa: E402
from tests.robustness import bombs  # noqa: E402

# Reads one file in a fresh process and prints its skip reason (or its size in characters),
# the time the read took, and the process's peak RSS before and after it.
MEASURE = textwrap.dedent("""
    import json, resource, sys, time
    from ragblend.integrations.readers import UnreadableFileError, extract_text
    data = open(sys.argv[1], "rb").read()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    try:
        outcome = f"{len(extract_text(sys.argv[2], data))} characters"
    except UnreadableFileError as err:
        outcome = f"skipped: {err}"
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"outcome": outcome, "seconds": seconds, "peak": peak, "gained": peak - before}))
""")


def measured(path, suffix) -> dict:
    done = subprocess.run([sys.executable, "-c", MEASURE, str(path), suffix], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("bomb, normal, suffix, reason", [
    (lambda: bombs.docx_bomb(400), lambda: bombs.normal_docx(1_000_000), ".docx", "its XML declares 400 MB"),
    (lambda: bombs.pdf_bomb(2000, 40), lambda: bombs.normal_pdf(350_000), ".pdf", "page 1 draws more than 4 MB"),
], ids=["docx-zip-bomb", "pdf-2000-pages-one-content-stream"])
def test_a_bomb_is_skipped_within_2x_the_memory_and_10_s_of_a_normal_file_of_its_size(tmp_path, bomb, normal,
                                                                                      suffix, reason):
    bomb_file, normal_file = tmp_path / f"bomb{suffix}", tmp_path / f"normal{suffix}"
    bomb_file.write_bytes(bomb())
    normal_file.write_bytes(normal())
    assert 0.8 < bomb_file.stat().st_size / normal_file.stat().st_size < 1.5   # of its size
    normal_read, bomb_read = measured(normal_file, suffix), measured(bomb_file, suffix)
    assert normal_read["outcome"].endswith("characters"), normal_read
    assert bomb_read["outcome"].startswith("skipped: ") and reason in bomb_read["outcome"], bomb_read
    assert "--read-limit" in bomb_read["outcome"]
    assert bomb_read["peak"] <= 2 * normal_read["peak"], (bomb_read, normal_read)
    assert bomb_read["gained"] <= 2 * normal_read["gained"] + 8 * 2**20, (bomb_read, normal_read)
    assert bomb_read["seconds"] <= normal_read["seconds"] + 10, (bomb_read, normal_read)


def test_docx_bombs_are_skipped_with_their_reason():
    with pytest.raises(OverLimitError, match=r"its XML declares 200 MB uncompressed, over the limit of 64 MB "
                                             r"expanded per file .* \(--read-limit expanded_mb=N raises it\)"):
        extract_text(".docx", bombs.docx_bomb(200, text=True))
    with pytest.raises(OverLimitError, match="zip entries 'word/header1.xml' and 'word/header2.xml' overlap"):
        extract_text(".docx", bombs.overlap_docx_bomb())
    # within a raised limit the same file is read, streaming: its text, never a tree of its XML
    assert extract_text(".docx", bombs.docx_bomb(70), ReadLimits(expanded_mb=80)) == ""


def test_inflated_bytes_are_counted_whatever_the_headers_declare():
    """A central directory that declares document.xml 1 KB long while its data inflates to 30 MB:
    the read stops at what was declared and the file is refused, without inflating the rest."""
    data = bytearray(bombs.docx_bomb(30))
    with zipfile.ZipFile(__import__("io").BytesIO(bytes(data))) as archive:
        info = archive.getinfo("word/document.xml")
    central = data.rfind(b"PK\x01\x02" + data[data.rfind(b"PK\x01\x02"):][4:6])   # document.xml: the last entry
    assert data[central + 46:central + 46 + len(info.filename)] == info.filename.encode()
    data[central + 24:central + 28] = (1024).to_bytes(4, "little")   # uncompressed size: 1 KB
    start = time.perf_counter()
    with pytest.raises(UnreadableFileError, match="not a readable DOCX file"):
        extract_text(".docx", bytes(data))
    assert time.perf_counter() - start < 5


def test_pdf_limits_pages_content_and_time():
    with pytest.raises(OverLimitError, match=r"its pages' content decodes to more than 64 MB"):
        extract_text(".pdf", bombs.pdf_bomb(2000, 1.0))   # 1 MB a page, under the page limit; 2 GB in all
    # the same through a form XObject every page draws; a form the pages only list costs nothing
    with pytest.raises(OverLimitError, match=r"its pages' content decodes to more than 64 MB"):
        extract_text(".pdf", bombs.form_pdf(2000, 1.0))
    with pytest.raises(OverLimitError, match=r"page 1 draws more than 4 MB"):
        extract_text(".pdf", bombs.form_pdf(10, 5.0))
    assert "ferry leaves at nine" in extract_text(".pdf", bombs.form_pdf(100, 3.0, drawn=False))
    normal = bombs.normal_pdf(60_000)
    assert "ferry" in extract_text(".pdf", normal) or "pier" in extract_text(".pdf", normal)
    with pytest.raises(OverLimitError, match=r"a PDF of \d+ pages, over the limit of 3 pages per file "
                                             r"\(--read-limit pages=N raises it\)"):
        extract_text(".pdf", normal, ReadLimits(pages=3))
    with pytest.raises(OverLimitError, match=r"over the limit of 1,000 characters per file"):
        extract_text(".pdf", normal, ReadLimits(chars=1000))
    # 40 pages of 100 KB of text operators each (~5 s in all): the deadline stops it after the page it is in
    # (checked every 256 operators; pypdf parses a page's content before its first one, at most page_mb)
    heavy = bombs.pdf_bomb(40, 0.1)
    start = time.perf_counter()
    with pytest.raises(OverLimitError, match=r"still reading after \d+ s, over the limit of 0.3 s per file "
                                             r"\(--read-limit seconds=N raises it\)"):
        extract_text(".pdf", heavy, ReadLimits(seconds=0.3))
    stopped = time.perf_counter() - start
    start = time.perf_counter()
    extract_text(".pdf", heavy)
    assert stopped < 0.5 * (time.perf_counter() - start)


def test_docx_and_memory_limits():
    document = bombs.normal_docx(300_000)
    with pytest.raises(OverLimitError, match=r"over the limit of 10,000 characters per file"):
        extract_text(".docx", document, ReadLimits(chars=10_000))
    # in a fresh process: in this one, memory freed by earlier tests is reused without growing the RSS
    code = ("import sys; from tests.robustness import bombs\n"
            "from ragblend.integrations.readers import ReadLimits, UnreadableFileError, extract_text\n"
            "try:\n    extract_text('.docx', bombs.normal_docx(300_000), ReadLimits(memory_mb=1))\n"
            "except UnreadableFileError as err:\n    print(err)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert re.search(r"reading it took \d+ MB more memory, over the limit of 1 MB per file "
                     r"\(--read-limit memory_mb=N raises it\)", done.stdout), (done.stdout, done.stderr)
    with pytest.raises(UnreadableFileError, match="declares a DTD"):
        extract_text(".docx", bombs._docx([b'<?xml version="1.0"?><!DOCTYPE d [<!ENTITY a "aaaa">]><d>&a;</d>']))


def test_read_limits_are_parsed_and_checked():
    assert ReadLimits.parse(["pages=5000", "seconds=1.5", "expanded-mb=128"]) == \
        ReadLimits(pages=5000, seconds=1.5, expanded_mb=128)
    for bad in (["pages"], ["colour=3"], ["pages=many"], ["pages=0"], ["pages=2.5"], ["seconds=nan"]):
        with pytest.raises(InvalidInputError, match="read.limit"):
            ReadLimits.parse(bad)


def test_the_cli_and_read_text_files_skip_bombs_with_their_reason(tmp_path, capsys):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "bomb.docx").write_bytes(bombs.docx_bomb(200))
    (docs / "bomb.pdf").write_bytes(bombs.pdf_bomb(2000, 5))
    (docs / "note.md").write_text("The ferry leaves at nine.\n")
    documents, report = read_text_files([docs])
    assert [d.metadata["file_name"] for d in documents] == ["note.md"]
    reasons = {os.path.basename(p): r for p, r in report.skipped}
    assert "expanded_mb" in reasons["bomb.docx"] and "page_mb" in reasons["bomb.pdf"]
    os.remove(docs / "note.md")
    start = time.perf_counter()
    assert main(["ingest", str(docs), "--index", str(tmp_path / "index")]) == 1   # nothing to ingest: no model
    assert time.perf_counter() - start < 10
    err = capsys.readouterr().err
    assert "bomb.docx: its XML declares 200 MB uncompressed" in err and "bomb.pdf: page 1 draws more" in err
    # --read-limit reaches the readers: with 1 page allowed, the 2,000-page file is refused for its pages
    assert main(["ingest", str(docs), "--read-limit", "pages=1", "--index", str(tmp_path / "index")]) == 1
    assert "a PDF of 2,000 pages, over the limit of 1 pages" in capsys.readouterr().err
    assert main(["ingest", str(docs), "--read-limit", "pages", "--index", str(tmp_path / "index")]) == 2
    assert "--read-limit 'pages' is not NAME=VALUE" in capsys.readouterr().err


def test_uploads_are_read_in_memory_within_the_limits(tmp_path):
    folder = tmp_path / "uploads"
    uploads = [("../../etc/note.md", b"The ferry leaves at nine.\n"), ("bomb.docx", bombs.docx_bomb(200)),
               ("big.md", b"word " * (3 * 2**20 // 5 + 1)), ("slides.pptx", b"PK"), ("..", b"x")]
    documents, report = read_uploads(uploads, folder, max_file_mb=3)
    assert [(d.id_, d.metadata["file_name"]) for d in documents] == [(str(folder / "note.md"), "note.md")]
    reasons = dict(report.skipped)
    assert "expanded_mb" in reasons[str(folder / "bomb.docx")]
    assert "over the 3 MB limit" in reasons[str(folder / "big.md")]
    assert reasons[str(folder / "slides.pptx")].startswith("unsupported file type .pptx")
    assert not folder.exists() and os.listdir(tmp_path) == []   # nothing written


def test_local_index_skips_documents_over_the_character_limit_before_tokenizing(tmp_path, tokenizer):
    """Documents given to ingest_documents (not read from files) are counted before any tokenizer
    sees them; the limits are the index's read_limits."""
    from llama_index.core import Document

    from ragblend.core.store.tiers import open_store
    from ragblend.integrations.local_index import LocalIndex

    from ..conftest import make_tiny_engine

    engine = make_tiny_engine("llama", tokenizer)
    engine.store = open_store(tmp_path / "index" / "kv", engine.entry_spec)
    rag = LocalIndex(tmp_path / "index", engine=engine, read_limits=ReadLimits(chars=2000))
    calls = []
    tokenize = engine.tokenize
    engine.tokenize = lambda text, *a, **k: calls.append(len(text)) or tokenize(text, *a, **k)
    report = rag.ingest_documents([Document(text="The ferry leaves at nine. " * 20, id_="small"),
                                   Document(text="word " * 1000, id_="large")], show_progress=False, kv="skip")
    assert report.skipped == [("large", "5,000 characters of text, over the limit of 2,000 characters per file "
                                         "(--read-limit chars=N raises it)")]
    assert report.nodes >= 1 and calls and max(calls) < 5000   # the large text never reached the tokenizer


# Review of issue 58's readers: forms, escaped names, pages over a limit, damaged trailers, memory
# counted per read, the characters a 10 MB file holds, deep forms, upload ids.

PATHS = b"10 10 m 20 20 l S\n"   # drawing operators: no text, what a vector figure is made of


def test_a_limit_reached_inside_a_form_stops_the_read():
    """pypdf catches Exception around each form it reads: the time limit must still stop it."""
    form = b"BT /F1 1 Tf ET\n" + PATHS * 60_000   # ~1 MB, no text, drawn 8 times by one page
    data = bombs.forms_pdf([bombs.text_content([b"a page of text"]) + b"\n" + b"/R Do\n" * 8], {"R": form})
    start = time.perf_counter()
    with pytest.raises(OverLimitError, match=r"still reading after \d+ s, over the limit of 0.5 s per file"):
        extract_text(".pdf", data, ReadLimits(seconds=0.5, page_mb=100, expanded_mb=200))
    assert time.perf_counter() - start < 4
    # a form counts each time it is drawn: 8 draws of 1 MB are over 4 MB a page
    with pytest.raises(OverLimitError, match=r"page 1 draws more than 4 MB of content"):
        extract_text(".pdf", data)


def test_forms_drawn_by_escaped_names_or_after_comments_are_counted():
    form = PATHS * 90_000   # ~1.5 MB
    for draw in (b"/B#69g Do", b"/Big %a comment\n Do", b"/Big\n%one\n%two\nDo"):
        data = bombs.forms_pdf([bombs.text_content([b"cover"]) + b"\n" + draw], {"Big": form})
        with pytest.raises(OverLimitError, match=r"page 1 draws more than 1 MB of content"):
            extract_text(".pdf", data, ReadLimits(page_mb=1))


def test_a_page_over_the_page_limit_is_left_out_and_the_others_read(tmp_path):
    """A paper with one dense vector figure: that page is skipped with its reason, not the file."""
    pages = [bombs.text_content([b"Section %d: results and discussion." % i] * 5) for i in range(10)]
    pages[4] = bombs.text_content([b"Figure 3: all measurements."]) + b"\n0.2 w\n" + PATHS * 300_000   # 5.4 MB
    left_out = []
    text = extract_text(".pdf", bombs.forms_pdf(pages), skipped=left_out)
    assert text.count("Section") == 45 and "Figure 3" not in text
    assert left_out == ["page 5 draws more than 4 MB of content, over the limit of 4 MB per page (--read-limit "
                        "page_mb=N raises it): that page was left out, the others read"]
    (tmp_path / "paper.pdf").write_bytes(bombs.forms_pdf(pages))
    documents, report = read_text_files([tmp_path])
    assert [d.metadata["file_name"] for d in documents] == ["paper.pdf"]
    assert report.skipped == [(str(tmp_path / "paper.pdf"), left_out[0])]
    # most pages over it: a bomb, refused whole, with the first page's reason and how many more
    with pytest.raises(OverLimitError, match=r"page 1 draws more than 4 MB of content, .*; so do 1 more of its "
                                             r"3 pages"):
        extract_text(".pdf", bombs.forms_pdf([pages[4], pages[4], pages[0]]))


def test_pdfs_pypdf_recovers_and_a_declared_page_count_are_read():
    pages = [bombs.text_content([b"one"]), bombs.text_content([b"two"])]
    assert extract_text(".pdf", bombs.forms_pdf(pages).replace(b"/Root 1 0 R", b"")) == "one\n\ntwo"
    assert extract_text(".pdf", bombs.forms_pdf(pages, count=100_000)) == "one\n\ntwo"   # 2 real pages
    with pytest.raises(OverLimitError, match=r"a PDF of 2 pages, over the limit of 1 pages"):
        extract_text(".pdf", bombs.forms_pdf(pages, count=0), ReadLimits(pages=1))


def test_memory_is_counted_for_the_read_not_for_the_process():
    """Another thread allocating (a second session, the model answering) is not charged to a file."""
    import threading

    document, held = bombs.normal_docx(1_000_000), []

    def other_session():
        for _ in range(20):
            held.append(b"\x01" * (10 * 2**20))
            time.sleep(0.005)

    other = threading.Thread(target=other_session)
    other.start()
    try:
        assert len(extract_text(".docx", document, ReadLimits(memory_mb=64))) > 100_000
    finally:
        other.join()
    assert len(held) == 20


def test_a_text_file_under_the_default_size_limit_is_within_the_default_characters(tmp_path):
    assert ReadLimits().chars >= 10 * 2**20
    (tmp_path / "notes.txt").write_bytes(b"Some notes. " * (10_388_000 // 12))
    documents, report = read_text_files([tmp_path])
    assert report.skipped == [] and len(documents[0].text) == 10_388_000 // 12 * 12


def test_forms_nested_too_deep_are_a_reason_not_a_crash():
    deep = {f"F{i}": (f"/F{i + 1} Do ".encode() if i < 1200 else b"") + bombs.text_content([b"level %d" % i])
            for i in range(1201)}
    with pytest.raises(UnreadableFileError, match=r"page 1: forms nested more than 32 deep"):
        extract_text(".pdf", bombs.forms_pdf([b"/F0 Do"], deep))
    left_out = []
    text = extract_text(".pdf", bombs.forms_pdf([bombs.text_content([b"cover"]), b"/F0 Do", b"/F1198 Do"], deep),
                        skipped=left_out)
    assert text.startswith("cover\n\n") and {"level 1198", "level 1199", "level 1200"} <= set(text.split("\n"))
    assert "level 1" not in text.replace("level 1198", "").replace("level 1199", "").replace("level 1200", "")
    assert left_out == ["page 2: forms nested more than 32 deep (no real document nests them so): that page was "
                        "left out, the others read"]
    shallow = {name: content for name, content in deep.items() if int(name[1:]) >= 1190}
    assert "level 1195" in extract_text(".pdf", bombs.forms_pdf([b"/F1190 Do"], shallow))


def test_upload_ids_are_resolved_like_every_document_id(tmp_path, monkeypatch):
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    monkeypatch.chdir(tmp_path)
    for folder in ("real/uploads", tmp_path / "link" / "uploads"):
        documents, _ = read_uploads([("notes.txt", b"The ferry leaves at nine.")], folder)
        assert documents[0].id_ == os.path.realpath(tmp_path / "real" / "uploads" / "notes.txt")
