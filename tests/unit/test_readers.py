"""The file types people have: PDF, HTML, DOCX and CSV/JSON read as text; an encrypted,
broken or text-less PDF, a missing optional library or a reader that raises skips that file
with its reason and never stops the ingest. The sample files are made here: a PDF written by
hand (one page, Helvetica text), a DOCX as the zip of XML files Word writes."""

import io
import subprocess
import sys
import zipfile

import pytest

pytest.importorskip("llama_index.core")

from ragblend.integrations import readers  # noqa: E402
from ragblend.integrations.local_index import read_text_files  # noqa: E402
from ragblend.integrations.readers import UnreadableFileError, extract_text  # noqa: E402

from ..robustness.bombs import pdf_file  # noqa: E402

TIMETABLE = ["Hallow Holm ferry timetable", "The ferry Saltwren leaves the north pier at 7:15 every morning.",
             "On Sundays the first crossing is at 9:40."]


def make_pdf(lines: list[str]) -> bytes:
    """A one-page PDF showing ``lines`` in Helvetica (objects, xref table and trailer by hand)."""
    text = " ".join(f"({line}) Tj T*" for line in lines)
    stream = f"BT /F1 12 Tf 14 TL 72 720 Td {text} ET".encode()
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>",
               b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
               b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R "
               b"/Resources << /Font << /F1 5 0 R >> >> >>",
               b"<< /Length %d >>\nstream\n" % len(stream) + stream + b"\nendstream",
               b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"]
    return pdf_file(objects)


def encrypted(pdf: bytes, password: str) -> bytes:
    from pypdf import PdfReader, PdfWriter

    writer = PdfWriter(clone_from=PdfReader(io.BytesIO(pdf)))
    writer.encrypt(user_password=password, owner_password="owner", algorithm="RC4-128")
    out = io.BytesIO()
    writer.write(out)
    return out.getvalue()


def make_docx(paragraphs: list[str]) -> bytes:
    """A minimal Word document: content types, the package relationship and document.xml."""
    body = "".join(f"<w:p><w:r><w:t>{p}</w:t></w:r></w:p>" for p in paragraphs)
    files = {
        "[Content_Types].xml": '<?xml version="1.0" encoding="UTF-8"?><Types xmlns="http://schemas.openxmlformats.org/'
                               'package/2006/content-types"><Default Extension="rels" ContentType="application/vnd.'
                               'openxmlformats-package.relationships+xml"/><Default Extension="xml" ContentType="'
                               'application/xml"/><Override PartName="/word/document.xml" ContentType="application/'
                               'vnd.openxmlformats-officedocument.wordprocessingml.document.main+xml"/></Types>',
        "_rels/.rels": '<?xml version="1.0" encoding="UTF-8"?><Relationships xmlns="http://schemas.openxmlformats.org/'
                       'package/2006/relationships"><Relationship Id="rId1" Type="http://schemas.openxmlformats.org/'
                       'officeDocument/2006/relationships/officeDocument" Target="word/document.xml"/></Relationships>',
        "word/document.xml": '<?xml version="1.0" encoding="UTF-8"?><w:document xmlns:w="http://schemas.openxmlformats'
                             f'.org/wordprocessingml/2006/main"><w:body>{body}</w:body></w:document>',
    }
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        for name, text in files.items():
            archive.writestr(name, text)
    return out.getvalue()


HTML = """<!doctype html><html><head><meta charset="utf-8"><title>Kite festival</title>
<style>body { color: red }</style><script>var secret = "not prose";</script></head>
<body><nav>Home</nav><h1>Lowenmark kite festival</h1>
<p>The kite festival is held on the west dunes on the first weekend of September.</p>
<p>The prize for the tallest kite is a smoked herring — caf&eacute; vouchers too.</p></body></html>"""


def test_pdf_text_is_extracted():
    text = extract_text(".pdf", make_pdf(TIMETABLE))
    assert all(line in text for line in TIMETABLE)


def test_pdf_encrypted_with_an_empty_password_opens_and_with_a_password_is_skipped_with_its_reason():
    assert "Saltwren" in extract_text(".pdf", encrypted(make_pdf(TIMETABLE), ""))
    with pytest.raises(UnreadableFileError, match="an encrypted PDF that needs a password; save an unencrypted copy"):
        extract_text(".pdf", encrypted(make_pdf(TIMETABLE), "hunter2"))


@pytest.mark.parametrize("data, reason", [
    (b"%PDF-1.4\n1 0 obj\n<< /Type /Catalog", "not a readable PDF"),
    (b"this is not a PDF at all", "not a readable PDF"),
    (make_pdf([])[:-40], "not a readable PDF|no text layer"),   # truncated: its xref and trailer cut off
    (make_pdf([]), "a PDF with no text layer .scanned pages.."),
])
def test_a_broken_or_textless_pdf_is_skipped_with_its_reason(data, reason):
    with pytest.raises(UnreadableFileError, match=reason):
        extract_text(".pdf", data)


def test_a_broken_pdf_prints_nothing_but_its_reason():
    """pypdf's own log lines stay out of a user's terminal (no logging configured, as in the CLI)."""
    code = ("from ragblend.integrations.readers import extract_text, UnreadableFileError\n"
            "try:\n    extract_text('.pdf', b'%PDF-1.4\\n1 0 obj\\n<< /Type /Catalog')\n"
            "except UnreadableFileError as err:\n    print(err)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "not a readable PDF" in done.stdout and done.stderr == "", done.stderr


def test_html_text_without_scripts_and_styles():
    text = extract_text(".html", HTML.encode())
    assert "Lowenmark kite festival" in text and "first weekend of September" in text and "café" in text
    assert "secret" not in text and "color" not in text


def test_docx_paragraphs():
    text = extract_text(".docx", make_docx(["Water plan", "The reservoir holds 40,000 cubic metres."]))
    assert text == "Water plan\nThe reservoir holds 40,000 cubic metres."
    with pytest.raises(UnreadableFileError, match="not a readable DOCX file"):
        extract_text(".docx", b"PK\x03\x04 broken zip")


def test_csv_and_json_are_read_as_text():
    assert extract_text(".csv", b"stop,time\nnorth pier,7:15\n") == "stop,time\nnorth pier,7:15\n"
    assert extract_text(".json", b'{"ferry": "Saltwren"}') == '{"ferry": "Saltwren"}'


def test_a_missing_library_names_the_pip_install(monkeypatch):
    for module, suffix, package in (("pypdf", ".pdf", "pypdf"), ("bs4", ".html", "beautifulsoup4")):
        monkeypatch.setitem(sys.modules, module, None)   # import fails as if it were not installed
        # ragblend is not on PyPI: the hint is the checkout's extra, not `pip install 'ragblend[readers]'`
        with pytest.raises(UnreadableFileError, match=rf"reading \{suffix} files needs {package}: pip install "
                                                      rf"{package} \(or, for every file type, pip install -e "
                                                      rf"'\S+\[readers\]'\)"):
            extract_text(suffix, b"anything")
    # DOCX is read with the standard library (zipfile, expat): it needs no docx2txt
    monkeypatch.setitem(sys.modules, "docx2txt", None)
    assert extract_text(".docx", make_docx(["Water plan"])) == "Water plan"


def test_bad_files_are_skipped_and_the_rest_ingested(tmp_path, monkeypatch):
    (tmp_path / "timetable.pdf").write_bytes(make_pdf(TIMETABLE))
    (tmp_path / "locked.pdf").write_bytes(encrypted(make_pdf(TIMETABLE), "hunter2"))
    (tmp_path / "broken.pdf").write_bytes(b"%PDF-1.7\n garbage")
    (tmp_path / "festival.html").write_bytes(HTML.encode())
    (tmp_path / "plan.docx").write_bytes(make_docx(["The reservoir holds 40,000 cubic metres."]))
    (tmp_path / "stops.csv").write_text("stop,time\nnorth pier,7:15\n")
    (tmp_path / "crash.htm").write_text("<p>a page whose reader has a bug</p>")
    (tmp_path / "slides.pptx").write_bytes(b"PK")

    def buggy(data):
        if b"bug" in data:
            raise RuntimeError("reader bug")
        return readers._html(data)

    monkeypatch.setitem(readers.READERS, ".htm", buggy)
    documents, report = read_text_files([tmp_path])
    assert sorted(d.metadata["file_name"] for d in documents) == ["festival.html", "plan.docx", "stops.csv",
                                                                   "timetable.pdf"]
    reasons = {p.rsplit("/", 1)[-1]: r for p, r in report.skipped}
    assert reasons["locked.pdf"].startswith("an encrypted PDF that needs a password")
    assert reasons["broken.pdf"].startswith("not a readable PDF")
    assert reasons["crash.htm"] == "the .htm reader failed (RuntimeError: reader bug)"
    assert reasons["slides.pptx"].startswith("unsupported file type .pptx; ragblend ingests ")
    assert ".pdf" in reasons["slides.pptx"] and ".docx" in reasons["slides.pptx"]
