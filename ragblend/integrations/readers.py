"""Text out of the files people have: plain text and markdown, CSV/JSON (as text), HTML, PDF, DOCX.

Each reader takes a file's bytes (read by :mod:`ragblend.integrations.local_index`, which
checks the file is a regular one of bounded size) and returns its text, or raises
:class:`UnreadableFileError` with the reason the file is skipped. HTML, PDF and DOCX need
small optional libraries (``pip install 'ragblend[readers]'``: beautifulsoup4, pypdf,
docx2txt); without one, files of that type are skipped with the ``pip install`` command.

These are the libraries LlamaIndex's own file readers (``llama-index-readers-file``) wrap;
ragblend calls them directly because that package pins ``pandas<3`` and adds nothing here,
and so that an encrypted or broken PDF gets its own reason instead of an exception.
"""

from __future__ import annotations

import codecs
import io
import logging
from typing import Callable

from ragblend.core.errors import RagblendError

# pypdf reports a damaged file through logging too; with no handler configured, Python would
# print its bare message ("EOF marker not found") before the skip reason ragblend gives.
logging.getLogger("pypdf").addHandler(logging.NullHandler())


class UnreadableFileError(RagblendError, ValueError):
    """A file whose text cannot be extracted; its message is the reason it is skipped."""


_BOMS = ((codecs.BOM_UTF32_LE, "utf-32"), (codecs.BOM_UTF32_BE, "utf-32"), (codecs.BOM_UTF8, "utf-8-sig"),
         (codecs.BOM_UTF16_LE, "utf-16"), (codecs.BOM_UTF16_BE, "utf-16"))


def decode_text(data: bytes) -> str | None:
    """The text of a file: UTF-8, or UTF-8/16/32 with a byte-order mark (as Windows editors
    save it); None for binary content. Raises UnicodeDecodeError for other encodings."""
    for bom, codec in _BOMS:   # UTF-32 first: its little-endian mark starts like UTF-16's
        if data.startswith(bom):
            return data.decode(codec)
    return None if b"\x00" in data else data.decode("utf-8")


def _plain(data: bytes) -> str:
    try:
        text = decode_text(data)
    except UnicodeDecodeError:
        raise UnreadableFileError("neither UTF-8 nor UTF-16/32 with a byte-order mark") from None
    if text is None:
        raise UnreadableFileError("binary content")
    return text


def _missing(package: str, suffix: str) -> UnreadableFileError:
    return UnreadableFileError(f"reading {suffix} files needs {package}: pip install {package} "
                               "(or pip install 'ragblend[readers]' for every file type)")


def _html(data: bytes) -> str:
    try:
        from bs4 import BeautifulSoup
    except ImportError:
        raise _missing("beautifulsoup4", ".html") from None
    # bs4 finds the encoding itself (meta charset, BOM, or a guess), so bytes go in as they are.
    soup = BeautifulSoup(data, "html.parser")
    for tag in soup(["script", "style", "noscript", "template", "svg"]):   # code and markup, not prose
        tag.decompose()
    lines = (line.strip() for line in soup.get_text("\n").splitlines())
    return "\n".join(line for line in lines if line)


def _pdf(data: bytes) -> str:
    try:
        from pypdf import PdfReader
        from pypdf.errors import FileNotDecryptedError, PdfReadError
    except ImportError:
        raise _missing("pypdf", ".pdf") from None
    try:
        reader = PdfReader(io.BytesIO(data))
        if reader.is_encrypted:
            # Many PDFs are "encrypted" with an empty user password (only printing or copying
            # is restricted): those open; a real password is not something ragblend can know.
            try:
                opened = reader.decrypt("")
            except (NotImplementedError, FileNotDecryptedError, PdfReadError) as err:
                # e.g. AES without the cryptography package: say what would open it
                raise UnreadableFileError(f"an encrypted PDF that pypdf cannot decrypt here ({err}); "
                                          "save an unencrypted copy (e.g. qpdf --decrypt IN OUT)") from None
            if not opened:
                raise UnreadableFileError("an encrypted PDF that needs a password; save an unencrypted copy "
                                          "(e.g. qpdf --password=PASSWORD --decrypt IN OUT) and ingest that")
        pages = [page.extract_text() or "" for page in reader.pages]
    except UnreadableFileError:
        raise
    except Exception as err:   # pypdf raises many kinds on damaged files (PdfReadError, KeyError, ValueError...)
        raise UnreadableFileError(f"not a readable PDF ({type(err).__name__}: {str(err)[:200]})") from None
    text = "\n\n".join(page.strip() for page in pages if page.strip())
    if not text:
        raise UnreadableFileError("a PDF with no text layer (scanned pages?); run OCR on it first "
                                  "(e.g. ocrmypdf IN OUT) and ingest the result")
    return text


def _docx(data: bytes) -> str:
    try:
        import docx2txt
    except ImportError:
        raise _missing("docx2txt", ".docx") from None
    try:
        text = docx2txt.process(io.BytesIO(data))
    except Exception as err:   # a damaged zip or document.xml
        raise UnreadableFileError(f"not a readable DOCX file ({type(err).__name__}: {str(err)[:200]})") from None
    lines = (line.strip() for line in text.splitlines())
    return "\n".join(line for line in lines if line)


TEXT_SUFFIXES = {".txt", ".md", ".markdown", ".rst", ".text"}
# Structured text is ingested as it is written: its keys and values read well enough as prose
# for retrieval, and nothing is lost.
DATA_SUFFIXES = {".csv", ".tsv", ".json", ".jsonl"}
READERS: dict[str, Callable[[bytes], str]] = {
    **{suffix: _plain for suffix in TEXT_SUFFIXES | DATA_SUFFIXES},
    ".html": _html, ".htm": _html, ".xhtml": _html,
    ".pdf": _pdf,
    ".docx": _docx,
}
SUPPORTED_SUFFIXES = frozenset(READERS)


def extract_text(suffix: str, data: bytes) -> str:
    """The text of a file with this suffix (lower case, with its dot) and content.

    Raises :class:`UnreadableFileError` with the reason the file cannot be read: an
    unsupported type, a missing optional library, an encrypted or damaged document, a reader
    that failed (any exception a reader raises is turned into a reason, so one bad file never
    stops an ingest)."""
    reader = READERS.get(suffix)
    if reader is None:
        raise UnreadableFileError(f"unsupported file type {suffix or '(none)'}; ragblend ingests "
                                  f"{', '.join(sorted(SUPPORTED_SUFFIXES))}")
    try:
        return reader(data)
    except UnreadableFileError:
        raise
    except Exception as err:   # a reader's own bug or a library's: the file is skipped, the ingest goes on
        raise UnreadableFileError(f"the {suffix} reader failed ({type(err).__name__}: {str(err)[:200]})") from None
