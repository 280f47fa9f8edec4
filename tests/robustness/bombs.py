"""Files that cost more than they weigh, and normal files of the same size to compare them with.

Used by the tests (tests/unit/test_readers_bombs.py) and the hostile-input benchmark
(tests/robustness/faults.py, ``Hostile.bomb_cases``). Each maker returns the file's bytes.

* :func:`docx_bomb`: a Word document whose document.xml inflates ~1000 times over (a 0.99 MB
  file of ~1 GB XML, as in issue 58);
* :func:`overlap_docx_bomb`: one compressed kernel named by many entries (overlapping entries);
* :func:`pdf_bomb`: a PDF whose pages all draw one content stream that inflates to tens of MB
  (as in issue 58: 349 KB, 2,000 pages);
* :func:`normal_docx`, :func:`normal_pdf`: documents of real prose of about a given size.
"""

from __future__ import annotations

import io
import random
import struct
import zipfile
import zlib

W_NS = "http://schemas.openxmlformats.org/wordprocessingml/2006/main"
CONTENT_TYPES = ('<?xml version="1.0" encoding="UTF-8"?><Types xmlns="http://schemas.openxmlformats.org/package/2006/'
                 'content-types"><Default Extension="rels" ContentType="application/vnd.openxmlformats-package.'
                 'relationships+xml"/><Default Extension="xml" ContentType="application/xml"/><Override PartName="/'
                 'word/document.xml" ContentType="application/vnd.openxmlformats-officedocument.wordprocessingml.'
                 'document.main+xml"/></Types>')
RELS = ('<?xml version="1.0" encoding="UTF-8"?><Relationships xmlns="http://schemas.openxmlformats.org/package/2006/'
        'relationships"><Relationship Id="rId1" Type="http://schemas.openxmlformats.org/officeDocument/2006/'
        'relationships/officeDocument" Target="word/document.xml"/></Relationships>')
HEAD = f'<?xml version="1.0" encoding="UTF-8"?><w:document xmlns:w="{W_NS}"><w:body>'.encode()
TAIL = b"</w:body></w:document>"
WORDS = ("ferry pier harbour lighthouse keeper tide morning evening island festival kite dune herring market "
         "reservoir water town council bridge road winter summer lantern boat crossing timetable north south").split()


def _docx(document_chunks, compresslevel: int = 9) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=compresslevel) as archive:
        archive.writestr("[Content_Types].xml", CONTENT_TYPES)
        archive.writestr("_rels/.rels", RELS)
        with archive.open("word/document.xml", "w", force_zip64=True) as part:
            for chunk in document_chunks:
                part.write(chunk)
    return out.getvalue()


def docx_bomb(inflated_mb: int = 400, text: bool = False) -> bytes:
    """A DOCX whose document.xml inflates to ``inflated_mb`` MB: empty runs (elements, no
    text: what a tree-building parser pays most for), or with ``text`` one run of repeated
    words. 400 MB weigh ~1 MB."""
    unit = b"<w:t>lighthouse keeper </w:t>" if text else b"<w:r><w:rPr><w:b/></w:rPr></w:r>"
    block = unit * ((1 << 20) // len(unit))
    body = [b"<w:p><w:r>" if text else b"<w:p>"] + [block] * inflated_mb + [b"</w:r></w:p>" if text else b"</w:p>"]
    return _docx([HEAD, *body, TAIL])


def normal_docx(size: int, seed: int = 0) -> bytes:
    """A DOCX of about ``size`` bytes of prose (random words from a small vocabulary, so it
    compresses like text does: ~3-4x)."""
    rng = random.Random(seed)

    def paragraphs(n):
        for _ in range(n):
            sentence = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 30))).capitalize() + "."
            yield f'<w:p><w:r><w:t xml:space="preserve">{sentence}</w:t></w:r></w:p>'.encode()

    sample = list(paragraphs(2000))
    ratio = len(_docx([HEAD, *sample, TAIL])) / len(sample)   # bytes of DOCX per paragraph
    return _docx([HEAD, *sample, *paragraphs(max(0, int(size / ratio) - 2000)), TAIL], compresslevel=9)


def overlap_docx_bomb(entries: int = 200, kernel_mb: int = 32) -> bytes:
    """Word parts word/header1..N.xml whose central directory entries all point at one
    compressed kernel (David Fifield's non-recursive zip bomb, without the quoting): a small
    file whose entries, read one by one, inflate to ``entries * kernel_mb`` MB."""
    kernel_xml = HEAD + b"<w:p><w:r><w:rPr><w:b/></w:rPr></w:r></w:p>" * (kernel_mb * (1 << 20) // 43) + TAIL
    compressor = zlib.compressobj(9, zlib.DEFLATED, -15)
    kernel = compressor.compress(kernel_xml) + compressor.flush()
    crc = zlib.crc32(kernel_xml)
    base = _docx([HEAD, b"<w:p><w:r><w:t>cover page</w:t></w:r></w:p>", TAIL], compresslevel=6)
    names = [f"word/header{i}.xml".encode() for i in range(1, entries + 1)]
    out, central = bytearray(), bytearray()
    with zipfile.ZipFile(io.BytesIO(base)) as archive:   # the real parts first, stored as they are
        for info in archive.infolist():
            offset = len(out)
            data = archive.read(info)
            packed = zlib.compressobj(6, zlib.DEFLATED, -15)
            packed_data = packed.compress(data) + packed.flush()
            name = info.filename.encode()
            out += struct.pack("<4s5H3L2H", b"PK\x03\x04", 20, 0, 8, 0, 0, zlib.crc32(data), len(packed_data),
                               len(data), len(name), 0) + name + packed_data
            central += struct.pack("<4s6H3L5H2L", b"PK\x01\x02", 20, 20, 0, 8, 0, 0, zlib.crc32(data),
                                   len(packed_data), len(data), len(name), 0, 0, 0, 0, 0, offset) + name
    kernel_offset = len(out)
    first = names[0]
    out += struct.pack("<4s5H3L2H", b"PK\x03\x04", 20, 0, 8, 0, 0, crc, len(kernel), len(kernel_xml),
                       len(first), 0) + first + kernel
    for name in names:   # every entry names the same local header and kernel
        central += struct.pack("<4s6H3L5H2L", b"PK\x01\x02", 20, 20, 0, 8, 0, 0, crc, len(kernel),
                               len(kernel_xml), len(name), 0, 0, 0, 0, 0, kernel_offset) + name
    count = 3 + len(names)
    end = struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, count, count, len(central), len(out), 0)
    return bytes(out + central + end)


def pdf_file(objects: list[bytes]) -> bytes:
    """A PDF of these numbered objects (the first the catalog), with its cross-reference table."""
    out, offsets = bytearray(b"%PDF-1.4\n"), []
    for number, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % number + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % offset for offset in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref)
    return bytes(out)


def _stream(content: bytes) -> bytes:
    packed = zlib.compress(content, 9)
    return b"<< /Length %d /Filter /FlateDecode >>\nstream\n" % len(packed) + packed + b"\nendstream"


FONT = b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"


def pdf_bomb(pages: int = 2000, content_mb: float = 40.0) -> bytes:
    """A PDF of ``pages`` pages that all draw one FlateDecode content stream of ``content_mb``
    MB of text operators (the stream inflates ~1000 times over: 2,000 pages weigh ~350 KB)."""
    op = b"BT /F1 12 Tf 72 720 Td (lighthouse) Tj ET\n"
    content = op * int(content_mb * (1 << 20) / len(op))
    kids = b" ".join(b"%d 0 R" % (5 + i) for i in range(pages))
    page = b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 3 0 R /Resources << /Font << /F1 4 0 R >> >> >>"
    return pdf_file([b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [" + kids + b"] /Count %d >>" % pages,
                 _stream(content), FONT] + [page] * pages)


def normal_pdf(size: int, seed: int = 0) -> bytes:
    """A PDF of about ``size`` bytes: pages of prose, each with its own content stream."""
    rng = random.Random(seed)
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>", b"", FONT]
    kids = []
    while sum(map(len, objects)) < size:
        lines = [" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(45)]
        content = b"BT /F1 10 Tf 12 TL 50 750 Td " + b" ".join(b"(%s) Tj T*" % line.encode() for line in lines) + b" ET"
        objects.append(_stream(content))
        objects.append(b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents %d 0 R "
                       b"/Resources << /Font << /F1 3 0 R >> >> >>" % len(objects))
        kids.append(b"%d 0 R" % len(objects))
    objects[1] = b"<< /Type /Pages /Kids [" + b" ".join(kids) + b"] /Count %d >>" % len(kids)
    return pdf_file(objects)


def picture_docx(size: int, seed: int = 0) -> bytes:
    """A DOCX of about ``size`` bytes as most are: a picture (incompressible bytes) and a
    paragraph of text."""
    rng = random.Random(seed)
    text = (b'<w:p><w:r><w:t xml:space="preserve">The Saltwren leaves the north pier of Lowenmark at 7:15 every '
            b'morning; the photograph shows the pier in winter.</w:t></w:r></w:p>')
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("[Content_Types].xml", CONTENT_TYPES)
        archive.writestr("_rels/.rels", RELS)
        archive.writestr("word/document.xml", HEAD + text + TAIL)
        archive.writestr("word/media/image1.png", rng.randbytes(max(0, size - 1500)))
    return out.getvalue()


def form_pdf(pages: int, form_mb: float, drawn: bool = True) -> bytes:
    """A PDF whose pages all name one form XObject of ``form_mb`` MB of text operators in
    their resources, and (``drawn``) draw it ("/X0 Do"); undrawn, each page shows a line of
    its own: a legitimate file that only lists the form."""
    op = b"BT /F1 12 Tf 72 720 Td (lighthouse) Tj ET\n"
    form = zlib.compress(op * int(form_mb * (1 << 20) / len(op)), 9)
    form_object = (b"<< /Type /XObject /Subtype /Form /BBox [0 0 612 792] /Resources << /Font << /F1 4 0 R >> >> "
                   b"/Length %d /Filter /FlateDecode >>\nstream\n" % len(form) + form + b"\nendstream")
    page_content = _stream(b"/X0 Do" if drawn else b"BT /F1 12 Tf 72 700 Td (The ferry leaves at nine.) Tj ET")
    kids = b" ".join(b"%d 0 R" % (6 + i) for i in range(pages))
    page = (b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 3 0 R "
            b"/Resources << /Font << /F1 4 0 R >> /XObject << /X0 5 0 R >> >> >>")
    return pdf_file([b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [" + kids + b"] /Count %d >>" % pages,
                 page_content, FONT, form_object] + [page] * pages)


def text_content(lines) -> bytes:
    """A page's content stream showing ``lines`` (bytes) in Helvetica, one under another."""
    body = b"BT /F1 11 Tf 50 750 Td 14 TL "
    for line in lines:
        body += b"(" + line.replace(b"(", b"\\(").replace(b")", b"\\)") + b") Tj T* "
    return body + b"ET"


def forms_pdf(pages, forms=None, count=None) -> bytes:
    """A PDF of the given page contents (bytes each), every page and form sharing one resource
    dictionary that names the ``forms`` ({name: content bytes}, FlateDecode form XObjects);
    ``count``: the /Count the page tree declares (default: the real number)."""
    forms = forms or {}
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>", b"", FONT]
    first_form = len(objects) + 2   # after the resources dictionary
    xobjects = b" ".join(b"/%s %d 0 R" % (name.encode(), first_form + i) for i, name in enumerate(forms))
    objects.append(b"<< /Font << /F1 3 0 R >> /XObject << %s >> >>" % xobjects)   # object 4
    for content in forms.values():
        packed = zlib.compress(content)
        objects.append(b"<< /Type /XObject /Subtype /Form /BBox [0 0 612 792] /Resources 4 0 R /Length %d "
                       b"/Filter /FlateDecode >>\nstream\n" % len(packed) + packed + b"\nendstream")
    kids = []
    for content in pages:
        objects.append(_stream(content))
        objects.append(b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Resources 4 0 R /Contents %d 0 R >>"
                       % len(objects))
        kids.append(b"%d 0 R" % len(objects))
    objects[1] = b"<< /Type /Pages /Kids [%s] /Count %d >>" % (b" ".join(kids), len(kids) if count is None else count)
    return pdf_file(objects)
