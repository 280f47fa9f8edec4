"""A PDF, an HTML page and a DOCX each answer a question with the real default model (reading the file types
themselves is tests/unit/test_readers.py)."""


import pytest

from ..conftest import ran_as_a_full_prefill
from ..unit.test_readers import HTML, TIMETABLE, make_docx, make_pdf

pytest.importorskip("llama_index.core")



@pytest.mark.slow
def test_a_pdf_an_html_page_and_a_docx_each_answer_a_question(smol_engine, tmp_path):
    from ragblend.integrations.local_index import LocalIndex
    from ragblend.vectorstore_hooks.llamaindex import llm_text

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "timetable.pdf").write_bytes(make_pdf(TIMETABLE))
    (docs / "festival.html").write_bytes(HTML.encode())
    (docs / "plan.docx").write_bytes(make_docx(["Lowenmark water plan",
                                                "The new reservoir above the town holds 40,000 cubic metres of water.",
                                                "It was finished in 2019."]))
    rag = LocalIndex(tmp_path / "index", engine=smol_engine)
    report = rag.ingest([docs], show_progress=False)
    assert len(report.files) == 3 and not report.skipped and rag.kv_coverage().fraction == 1.0
    for question, source, answer in [
            ("What is the name of the ferry that leaves the north pier?", "timetable.pdf", "Saltwren"),
            ("When is the kite festival held?", "festival.html", "September"),
            ("How much water does the new reservoir hold?", "plan.docx", "40,000")]:
        result = rag.ask(question, top_k=1, max_new_tokens=32)
        assert result.sources[0].node.metadata["file_name"] == source
        assert answer in result.text, (question, result.text)
        # Ingest stored the chunk's KV; a chunk this short runs as a plain prefill beside the
        # prompt's template, which computes less than fusing it.
        assert rag.engine.key_of(llm_text(result.sources[0].node)) in rag.engine.store
        assert result.stats.chunks_reused == 1 or ran_as_a_full_prefill(result.stats)
