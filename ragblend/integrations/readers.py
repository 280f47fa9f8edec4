"""Text out of the files people have: plain text and markdown, CSV/JSON (as text), HTML, PDF, DOCX.

Each reader takes a file's bytes (read by :mod:`ragblend.integrations.local_index`, which
checks the file is a regular one of bounded size) and returns its text, or raises
:class:`UnreadableFileError` with the reason the file is skipped. HTML and PDF need small
optional libraries (the ``readers`` extra: ``pip install -e '.[readers]'`` in the checkout;
beautifulsoup4, pypdf); without one, files of that type are skipped with the ``pip install``
command. DOCX is read with the
standard library (zipfile and expat), so that what its zip expands to is counted as it is
inflated.

A file may weigh little and expand to a lot (a zip bomb, a PDF whose pages all draw one huge
content stream): :class:`ReadLimits` bounds what one file may expand to, the pages, the
characters, the time and the memory its reading takes, and a file over a limit is skipped
with :class:`OverLimitError` saying which limit and how to raise it.

pypdf and beautifulsoup4 are the libraries LlamaIndex's own file readers
(``llama-index-readers-file``) wrap; ragblend calls them directly because that package pins
``pandas<3`` and adds nothing here, and so that an encrypted or broken PDF gets its own reason
instead of an exception.
"""

from __future__ import annotations

import codecs
import contextvars
import dataclasses
import io
import logging
import re
import sys
import time
import zipfile
import zlib
from dataclasses import dataclass
from typing import Callable, Iterable

from ragblend.core.errors import InvalidInputError, RagblendError
from ragblend.core.extras import install_command

# pypdf reports a damaged file through logging too; with no handler configured, Python would
# print its bare message ("EOF marker not found") before the skip reason ragblend gives.
logging.getLogger("pypdf").addHandler(logging.NullHandler())
log = logging.getLogger(__name__)


class UnreadableFileError(RagblendError, ValueError):
    """A file whose text cannot be extracted; its message is the reason it is skipped."""


class OverLimitError(UnreadableFileError):
    """A file that expands past one of its :class:`ReadLimits`; the message names the limit."""


class _StopReading(BaseException):
    """Carries an :class:`OverLimitError` out of pypdf, which catches ``Exception`` around each
    form it extracts (and would log the limit away and read on); :func:`_pdf` raises the error."""

    def __init__(self, error: OverLimitError):
        super().__init__(str(error))
        self.error = error


MB = 2**20


@dataclass(frozen=True)
class ReadLimits:
    """What reading one file may cost. The defaults let through documents longer than people
    write (2,000 PDF pages, 16 million characters: ~8,000 pages of prose, and more than a text
    file under the default 10 MB file size holds) and stop the bombs of issue 58 within a
    second; each is changed with ``ragblend ingest --read-limit NAME=VALUE`` or
    ``ReadLimits(NAME=VALUE)``. A PDF page over ``page_mb`` is skipped (its reason logged and
    reported) and the file's other pages kept, unless most of its pages are over it or the
    pages measured add up past ``expanded_mb``: then the file is a bomb, and refused."""

    expanded_mb: float = 64.0   # bytes a file expands to: a DOCX's XML inflated, a PDF's page contents decoded
    page_mb: float = 4.0        # one PDF page's content decoded (pypdf holds ~40x this while parsing it)
    pages: int = 2000           # pages of a PDF
    chars: int = 16_000_000     # characters of text a file gives (>= the bytes of a file under the default 10 MB)
    seconds: float = 60.0       # this thread's CPU time reading one file (checked between pages, between 1 MB
                                # of XML, every 256 PDF operators); time waiting for other threads is not counted
    memory_mb: float = 1024.0   # memory this read holds: the file, its text so far, and the content being parsed
                                # (a PDF page's, x40 as pypdf holds it); checked as seconds are

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or value != value:
                raise InvalidInputError(f"read limit {field.name} must be a number > 0, got {value!r}.")
            if field.type == "int" and value != int(value):   # (annotations are strings here)
                raise InvalidInputError(f"read limit {field.name} must be a whole number, got {value!r}.")

    @classmethod
    def parse(cls, settings: Iterable[str]) -> "ReadLimits":
        """Limits from ``NAME=VALUE`` strings (``pages=5000``), the rest at their defaults."""
        names = {f.name: f.type for f in dataclasses.fields(cls)}
        values = {}
        for setting in settings:
            name, _, text = setting.partition("=")
            name = name.strip().replace("-", "_")
            if name not in names or not text.strip():
                raise InvalidInputError(f"--read-limit {setting!r} is not NAME=VALUE with NAME one of "
                                        f"{', '.join(names)}.")
            try:
                values[name] = int(text) if names[name] == "int" else float(text)
            except ValueError:
                raise InvalidInputError(f"--read-limit {setting!r}: {text.strip()!r} is not a number.") from None
        return cls(**values)


def _over(what: str, limit: str, name: str) -> OverLimitError:
    return OverLimitError(f"{what}, over the limit of {limit} (--read-limit {name}=N raises it)")


# Time is this thread's CPU time: a read that waits for the GIL or for other threads (another
# session, the model answering) is not charged for their work.
_clock = time.thread_time if hasattr(time, "thread_time") else time.monotonic

# How much memory pypdf holds while it parses a page, per byte of the page's decoded content
# (measured on text-operator pages: ~40x).
PDF_PARSE_FACTOR = 40


class Budget:
    """One file's reading against its limits: readers report what they expand and extract,
    and call :meth:`check` between pieces of work (a page, 1 MB of XML, 256 PDF operators)."""

    def __init__(self, limits: ReadLimits):
        self.limits = limits
        self.started = _clock()
        self.expanded = 0
        self.chars = 0
        self.operators = 0
        # Memory is counted, not measured: the process's resident size includes what every
        # other thread allocates, and Python offers no per-thread count (tracemalloc traces
        # the whole process too). What a read holds: the file, its text, the piece in parsing.
        self.held = 0        # bytes kept for the whole read (the file, the text extracted so far)
        self.parsing = 0     # bytes held for the piece being parsed now (a PDF page, 1 MB of XML)
        self.skipped: list[str] = []   # the reasons parts of the file were left out (a PDF page over page_mb)

    def expand(self, n: int, what: str) -> None:
        """``n`` more bytes expanded (``what``: "its XML inflates", "its pages' content decodes")."""
        self.expanded += n
        if self.expanded > self.limits.expanded_mb * MB:
            raise _over(f"{what} to more than {self.limits.expanded_mb:g} MB", f"{self.limits.expanded_mb:g} MB "
                        "expanded per file (a zip or content bomb?)", "expanded_mb")

    def add_chars(self, n: int) -> None:
        self.chars += n
        if self.chars > self.limits.chars:
            raise _over(f"more than {self.limits.chars:,} characters of text", f"{self.limits.chars:,} characters "
                        "per file", "chars")

    def check(self) -> None:
        elapsed = _clock() - self.started
        if elapsed > self.limits.seconds:
            raise _over(f"still reading after {elapsed:.0f} s", f"{self.limits.seconds:g} s per file", "seconds")
        used = self.held + self.parsing
        if used > self.limits.memory_mb * MB:
            raise _over(f"reading it took {used / MB:.0f} MB more memory", f"{self.limits.memory_mb:g} MB "
                        "per file", "memory_mb")

    def visit_operator(self, *_) -> None:
        """pypdf's ``visitor_operand_before``: called for every operator of a page and of the
        forms it draws, so that one page cannot run past the time or memory limit. pypdf
        catches ``Exception`` around each form, so the limit leaves as :class:`_StopReading`."""
        self.operators += 1
        if self.operators % 256 == 0:
            try:
                self.check()
            except OverLimitError as err:
                raise _StopReading(err) from None


# The budget of the file extract_text is reading (a context variable, like pypdf's own
# configuration): the readers keep their one-argument signature, and threads never share one.
_BUDGET: contextvars.ContextVar[Budget | None] = contextvars.ContextVar("ragblend_read_budget", default=None)


def _budget() -> Budget:
    return _BUDGET.get() or Budget(ReadLimits())


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
                               f"(or, for every file type, {install_command('readers')})")


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


def _decoded(stream, cap: int) -> bytes:
    """What a PDF stream decodes to, up to about ``cap`` bytes (a longer one is cut there): a
    FlateDecode stream is inflated here 1 MB at a time (a 300 KB stream can inflate to 300 MB);
    other filters are decoded by pypdf, within its own limits."""
    filters = stream.get("/Filter")
    if isinstance(filters, list) and len(filters) == 1:
        filters = filters[0]
    raw = getattr(stream, "_data", None)   # the encoded bytes (pypdf keeps them there since 1.x)
    if filters is None and isinstance(raw, bytes):
        return raw[:cap + 1]
    if filters in ("/FlateDecode", "/Fl") and isinstance(raw, bytes):
        inflater, pieces, size, pending = zlib.decompressobj(zlib.MAX_WBITS | 32), [], 0, raw
        try:
            while pending and size <= cap:
                pieces.append(inflater.decompress(pending, MB))
                size += len(pieces[-1])
                pending = inflater.unconsumed_tail
            return b"".join(pieces)
        except zlib.error:
            pass   # damaged: pypdf has its own recovery, within its limits
    try:
        return stream.get_data()
    except Exception:   # undecodable: pypdf skips it when extracting too
        return b""


# The forms a content stream draws: "/Name Do" (names end at whitespace or a delimiter;
# comments may stand between the name and Do). pypdf decodes "#xx" escapes in names
# ("/B#69g" is "/Big"), so the names found here are decoded the same way.
_DRAWS = re.compile(rb"/([^\s/\[\]()<>{}%]+)(?:\s|%[^\r\n]*)*Do(?![^\s/\[\]()<>{}%])")
_NAME_ESCAPE = re.compile(rb"#([0-9A-Fa-f]{2})")
# Forms drawing forms deeper than this: no real document does, and pypdf recurses per level.
MAX_FORM_DEPTH = 32


def _drawn_names(data: bytes) -> dict[str, int]:
    """How many times the content ``data`` draws each form name."""
    counts: dict[str, int] = {}
    for raw in _DRAWS.findall(data):
        name = _NAME_ESCAPE.sub(lambda m: bytes([int(m.group(1), 16)]), raw)
        try:
            text = name.decode("utf-8")
        except UnicodeDecodeError:
            text = name.decode("latin-1")
        counts[text] = counts.get(text, 0) + 1
    return counts


def _page_content_size(page, cap: int, measured: dict) -> int:
    """The bytes of content pypdf parses to extract a page's text: its content streams, and
    the forms they draw (by name, in their resources) and those forms draw, counted once per
    draw (pypdf parses a form each time it is drawn); counting stops just past ``cap``.
    ``measured`` caches each stream's (size, names drawn) across the pages of a file. Raises
    UnreadableFileError for forms nested more than MAX_FORM_DEPTH deep."""
    from pypdf.generic import StreamObject

    def forms_of(resources) -> dict:
        resources = resources.get_object() if resources is not None else None
        xobjects = resources.get("/XObject") if isinstance(resources, dict) else None
        xobjects = xobjects.get_object() if xobjects is not None else None
        return dict(xobjects) if isinstance(xobjects, dict) else {}

    total = 0
    # (object, the resources it is drawn with, how many times it is drawn, the forms drawing it)
    stack = [(page.get("/Contents"), page.get("/Resources"), 1, ())]
    while stack and total <= cap:
        obj, resources, times, drawers = stack.pop()
        obj = obj.get_object() if obj is not None else None
        if isinstance(obj, list):
            stack.extend((item, resources, times, drawers) for item in reversed(obj))
            continue
        if not isinstance(obj, StreamObject) or id(obj) in drawers:   # a form drawing itself: counted once
            continue
        if len(drawers) > MAX_FORM_DEPTH:
            raise UnreadableFileError(f"forms nested more than {MAX_FORM_DEPTH} deep (no real document nests "
                                      "them so)")
        if id(obj) not in measured:   # the stream object stays in pypdf's cache: its id stays its own
            data = _decoded(obj, cap)
            measured[id(obj)] = (obj, len(data), _drawn_names(data))
        _, size, names = measured[id(obj)]
        total += size * times
        own = obj.get("/Resources")
        own = own if own is not None else resources
        forms = forms_of(own)
        for name, count in names.items():
            form = forms.get("/" + name)
            form = form.get_object() if form is not None else None
            if isinstance(form, StreamObject) and form.get("/Subtype") == "/Form":
                stack.append((form, own, times * count, drawers + (id(obj),)))
    return total


def _check_pdf_size(reader, budget: Budget) -> dict[int, int]:
    """Before any page is parsed: the page count, and what each page's content decodes to (a
    stream drawn by many pages counts for each: pypdf parses it for each). A page over
    ``page_mb`` (or nesting forms too deep) is left out, its reason in ``budget.skipped``;
    most pages over it, or the pages measured over ``expanded_mb``, and the file is refused.
    Returns the content size of each page to read, by page index."""
    limits = budget.limits
    count = len(reader.pages)   # pypdf walks the real page tree; a declared /Count may lie
    if count > limits.pages:
        raise _over(f"a PDF of {count:,} pages", f"{limits.pages:,} pages per file", "pages")
    page_cap, measured, sizes, refused = int(limits.page_mb * MB), {}, {}, []

    def bomb() -> UnreadableFileError:
        first = refused[0]
        if len(refused) == 1:
            return first
        return type(first)(f"{first}; so do {len(refused) - 1:,} more of its {count:,} pages")

    for index, page in enumerate(reader.pages):
        drawn = 0
        try:
            drawn = _page_content_size(page, page_cap, measured)
            if drawn > page_cap:
                raise _over(f"page {index + 1} draws more than {limits.page_mb:g} MB of content",
                            f"{limits.page_mb:g} MB per page", "page_mb")
            sizes[index] = drawn
        except UnreadableFileError as err:
            if not str(err).startswith("page "):
                err = type(err)(f"page {index + 1}: {err}")
            refused.append(err)
            drawn = min(drawn, page_cap + 1)   # what measuring it decoded
            if 2 * len(refused) > count:   # most of the file: a bomb, not a figure
                raise bomb() from None
        try:
            budget.expand(drawn, "its pages' content decodes")
        except OverLimitError:
            if refused:
                raise bomb() from None
            raise
        budget.check()
    budget.skipped += [f"{err}: that page was left out, the others read" for err in refused]
    return sizes


def _pdf(data: bytes) -> str:
    try:
        from pypdf import PdfReader
        from pypdf.errors import FileNotDecryptedError, PdfReadError
    except ImportError:
        raise _missing("pypdf", ".pdf") from None
    budget = _budget()
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
        sizes = _check_pdf_size(reader, budget)
        pages = []
        for index, page in enumerate(reader.pages):
            if index not in sizes:   # over a limit: left out, its reason in budget.skipped
                continue
            budget.parsing = PDF_PARSE_FACTOR * sizes[index]
            budget.check()
            pages.append(page.extract_text(visitor_operand_before=budget.visit_operator) or "")
            budget.parsing = 0
            budget.add_chars(len(pages[-1]))
            budget.held += len(pages[-1])
            budget.check()
    except _StopReading as stop:   # a limit reached inside a form (see _StopReading)
        raise stop.error from None
    except UnreadableFileError:
        raise
    except RecursionError:
        raise UnreadableFileError("not a readable PDF (its objects nest too deep)") from None
    except Exception as err:   # pypdf raises many kinds on damaged files (PdfReadError, KeyError, ValueError...)
        raise UnreadableFileError(f"not a readable PDF ({type(err).__name__}: {str(err)[:200]})") from None
    text = "\n\n".join(page.strip() for page in pages if page.strip())
    if not text:
        raise UnreadableFileError("a PDF with no text layer (scanned pages?); run OCR on it first "
                                  "(e.g. ocrmypdf IN OUT) and ingest the result")
    return text


# The parts of a Word document that hold its text, in the order they are read (as docx2txt did).
_DOCX_PARTS = (re.compile(r"word/header\d*\.xml"), re.compile(r"word/document\.xml"), re.compile(r"word/footer\d*\.xml"))
_W = "http://schemas.openxmlformats.org/wordprocessingml/2006/main "   # expat's "namespace name" prefix


def _check_zip_layout(entries: list) -> None:
    """Refuse entries whose data overlap (one compressed kernel named by many entries: a zip
    bomb that expands a small file many times over); no legitimate zip writer makes them."""
    ordered = sorted(entries, key=lambda e: e.header_offset)
    for before, after in zip(ordered, ordered[1:]):
        # 30 bytes: the smallest local header; the data of `before` ends no earlier than this
        if after.header_offset < before.header_offset + 30 + before.compress_size:
            raise OverLimitError(f"zip entries {before.filename!r} and {after.filename!r} overlap (a zip bomb); "
                                 "no Word document is written that way")


_BREAKS = {"tab": "\t", "br": "\n", "cr": "\n", "p": "\n\n"}


def _docx_part_text(stream, budget: Budget, out: list[str]) -> None:
    """Stream one XML part through expat, 1 MB at a time, keeping only its text: w:t runs,
    a tab for w:tab, a line break for w:br/w:cr, a blank line before each w:p."""
    import xml.parsers.expat

    parser = xml.parsers.expat.ParserCreate(namespace_separator=" ")
    in_text, chars, kept = False, 0, 0   # kept: the bytes the text pieces take in memory

    def start(name, _attrs):
        nonlocal in_text, chars
        tag = name[len(_W):] if name.startswith(_W) else ""
        in_text = tag == "t"
        if tag in _BREAKS:
            out.append(_BREAKS[tag])
            chars += len(_BREAKS[tag])

    def end(_name):
        nonlocal in_text
        in_text = False

    def characters(data):
        nonlocal chars, kept
        if in_text:
            out.append(data)
            chars += len(data)
            kept += sys.getsizeof(data) + 8   # the str and its place in the list

    def refuse_dtd(*_):   # Word writes none; a DTD is how entity expansion bombs start
        raise UnreadableFileError("not a readable DOCX file (its XML declares a DTD)")

    parser.StartElementHandler, parser.EndElementHandler, parser.CharacterDataHandler = start, end, characters
    parser.StartDoctypeDeclHandler = parser.EntityDeclHandler = refuse_dtd
    counted, counted_kept = 0, 0
    while True:
        piece = stream.read(MB)   # zipfile inflates at most about this much per read
        budget.expand(len(piece), "its XML inflates")   # counted as inflated, whatever the headers say
        budget.parsing = len(piece)
        parser.Parse(piece, not piece)
        budget.add_chars(chars - counted)
        budget.held += kept - counted_kept
        counted, counted_kept = chars, kept
        budget.check()
        budget.parsing = 0
        if not piece:
            return


def _docx(data: bytes) -> str:
    budget = _budget()
    out: list[str] = []
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            entries = archive.infolist()
            _check_zip_layout(entries)
            names = [e.filename for e in entries]
            if "word/document.xml" not in names:
                raise UnreadableFileError("not a readable DOCX file (it has no word/document.xml)")
            parts = [e for pattern in _DOCX_PARTS for e in entries if pattern.fullmatch(e.filename)]
            declared = sum(e.file_size for e in parts)
            if declared > budget.limits.expanded_mb * MB:   # the cheap check first; the real count is below
                raise _over(f"its XML declares {declared / MB:,.0f} MB uncompressed",
                            f"{budget.limits.expanded_mb:g} MB expanded per file (a zip bomb?)", "expanded_mb")
            for entry in parts:
                with archive.open(entry) as stream:
                    _docx_part_text(stream, budget, out)
    except UnreadableFileError:
        raise
    except Exception as err:   # a damaged zip (bad CRC, truncated) or XML
        raise UnreadableFileError(f"not a readable DOCX file ({type(err).__name__}: {str(err)[:200]})") from None
    lines = (line.strip() for line in "".join(out).splitlines())
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


def extract_text(suffix: str, data: bytes, limits: ReadLimits | None = None,
                 skipped: list[str] | None = None) -> str:
    """The text of a file with this suffix (lower case, with its dot) and content, read
    within ``limits`` (default: :class:`ReadLimits`'s defaults). The reasons parts of the
    file were left out (a PDF page over ``page_mb``) are appended to ``skipped`` and logged.

    Raises :class:`UnreadableFileError` with the reason the file cannot be read: an
    unsupported type, a missing optional library, an encrypted or damaged document, a file
    over one of its limits (:class:`OverLimitError`), a reader that failed (any exception a
    reader raises is turned into a reason, so one bad file never stops an ingest)."""
    reader = READERS.get(suffix)
    if reader is None:
        raise UnreadableFileError(f"unsupported file type {suffix or '(none)'}; ragblend ingests "
                                  f"{', '.join(sorted(SUPPORTED_SUFFIXES))}")
    budget = Budget(limits or ReadLimits())
    budget.held = len(data)
    token = _BUDGET.set(budget)
    try:
        text = reader(data)
        # Plain text and HTML do not expand (their cost follows their size): checked once read.
        budget.add_chars(len(text) - budget.chars)
        budget.check()
        for reason in budget.skipped:
            log.warning("part of a %s file left out: %s", suffix, reason)
        if skipped is not None:
            skipped += budget.skipped
        return text
    except UnreadableFileError:
        raise
    except Exception as err:   # a reader's own bug or a library's: the file is skipped, the ingest goes on
        raise UnreadableFileError(f"the {suffix} reader failed ({type(err).__name__}: {str(err)[:200]})") from None
    finally:
        _BUDGET.reset(token)
