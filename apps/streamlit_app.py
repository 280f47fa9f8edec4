"""ragblend demo RAG app.

    ragblend app                          # or: streamlit run apps/streamlit_app.py

Ingest text/markdown files into a persistent Chroma index (their KV is precomputed), ask
questions, and see what fusion does: the streamed answer and its time to first token, the
same for a full prefill of the same prompt, which chunks were reused, the prompt with the
recomputed tokens highlighted, and TTFT over the session. Each path gets one untimed warm-up
answer per process before its first timed one, as in `ragblend ask --compare`
(:mod:`ragblend.integrations.compare`, which also words the ratio); the sidebar shows the
ratio the default strategy runs at, and each answer a waiting indicator until its first
token. ``RAGBLEND_INDEX_DIR`` and ``RAGBLEND_MODEL`` set the index folder and the model path,
``RAGBLEND_CHROMA_URL`` a Chroma server to use instead of the database in the index folder
(``RAGBLEND_CHROMA_COLLECTION`` its collection): the operator's settings, shown to the page's
visitors but not changeable by them.

The app has no login: ``ragblend app`` listens on 127.0.0.1 unless given ``--host``. Visitors
ingest what they upload; the "file or folder on this machine" box exists only when the operator
names a folder it may read (``ragblend app --files-root DIR``, or ``RAGBLEND_FILES_ROOT``), and
takes only paths inside it (after resolving links and ``..``). Uploads are read in memory within
the same limits as `ragblend ingest` (file size, what a file expands to, pages, characters, time,
memory): nothing is written to disk for them, so an upload the app refuses leaves nothing behind.

Text that comes from documents, file names, the model or errors is shown as text, so a document
cannot add a link, an image (a request to another site), HTML or formatting to the page:
document text and answers as HTML-escaped HTML blocks, which Markdown leaves alone
(:func:`as_text`); file names and reasons in Markdown with every punctuation character escaped
(:func:`md`).
"""

from __future__ import annotations

import html
import os
import re
from pathlib import Path

import streamlit as st

from ragblend.core.calibration.record import UNCALIBRATED
from ragblend.core.errors import RagblendError
from ragblend.core.fusion.strategies import takes_ratio as strategy_takes_ratio
from ragblend.core.paths import cache_dir
from ragblend.data import load_sample, sample_dir
from ragblend.integrations.compare import FULL_PREFILL, fusion_only, warm_up, warmed_paths
from ragblend.integrations.compare import compare as compare_stats

STRATEGIES = {"default": "QueryAware (the model's calibrated ratio)", "query_aware": "QueryAware (ratio below)",
              "cacheblend": "CacheBlend (ratio below)", "legolink": "LegoLink (first k tokens)",
              "full_reuse": "Full reuse (no recompute)", "full_recompute": "Full recompute (plain prefill)"}

st.set_page_config(page_title="ragblend", layout="wide")


@st.cache_resource(show_spinner="Loading the model and the index...")
def open_index(index_dir: str, model_path: str, chroma_url: str, collection: str):
    from ragblend import BlendEngine
    from ragblend.integrations.local_index import LocalIndex, chroma_client

    chroma_client(Path(index_dir), chroma_url or None)  # an unreachable server fails before the model loads
    engine = BlendEngine.from_pretrained(model_path or None, kv_dir=Path(index_dir) / "kv")
    return LocalIndex(index_dir, engine=engine, chroma_url=chroma_url or None, collection=collection)


def paths_are_warm(rag, paths) -> bool:
    return set(paths) <= warmed_paths(rag.engine)


# Every ASCII punctuation character but the full stop: links, images, HTML, emphasis, code,
# math, Streamlit's :color[...] directives all need one. Markdown shows a backslash-escaped
# punctuation character as itself, so the text reads the same.
_PUNCTUATION = re.compile(r"([!-\-/:-@\[-`{-~])")
# "1." opening a line makes a list.
_LIST_NUMBER = re.compile(r"^(\d{1,9})\.")
# Links made of plain text (http://, www., a@b.c) are found after escapes are undone: an invisible
# word joiner (U+2060) before the ":", "." or "@" they start from keeps them text.
_AUTOLINK = re.compile(r"(?i)(?<=https)(?=\\:)|(?<=http)(?=\\:)|(?<=www)(?=\.)|(?=\\@)")


def md(text) -> str:
    """``text`` shown literally in Streamlit Markdown (an alert, a progress label), on one
    line: control characters (a newline too) escaped, every punctuation character that could
    make a link, an image, HTML or formatting backslash-escaped, autolinks broken."""
    from ragblend.integrations.local_index import printable

    escaped = _LIST_NUMBER.sub(r"\1\\.", _PUNCTUATION.sub(r"\\\1", printable(text)))
    return _AUTOLINK.sub("\u2060", escaped)


def as_text(text, *, lines: bool = False) -> str:
    """``text`` (a document's, the model's) as an HTML block for ``st.markdown(...,
    unsafe_allow_html=True)`` that shows it as it is: HTML-escaped, and on one line of source
    (a blank line would end the block and let Markdown parse what follows). ``lines`` keeps
    its line breaks (as <br>); otherwise control characters are shown escaped."""
    from ragblend.integrations.local_index import printable

    if lines:
        shown = "<br>".join(html.escape(printable(line)) for line in str(text).split("\n"))
    else:
        shown = html.escape(printable(text))
    return f'<div class="ragblend-text">{shown}</div>'


def highlighted_prompt(engine, trace) -> str:
    """The prompt as HTML: recomputed tokens highlighted, reused chunk tokens plain."""
    recomputed = trace.recomputed.tolist()
    in_chunk = [False] * len(trace.token_ids)
    for span in trace.chunk_spans:
        in_chunk[span.start:span.end] = [True] * (span.end - span.start)
    pieces = []
    for token, fresh, chunk in zip(trace.token_ids, recomputed, in_chunk):
        # Escaped, and no newline: a blank line would end the HTML block and let Markdown parse
        # the document text after it (an image link there would be fetched).
        text = html.escape(engine.tokenizer.decode([token])).replace("\r", "&#13;").replace("\n", "&#10;")
        if fresh:
            color = "#ffd166" if chunk else "#e9ecef"
            text = f'<span style="background:{color}">{text}</span>'
        pieces.append(text)
    return ('<div style="white-space:pre-wrap;font-family:monospace;font-size:0.8em;max-height:22em;'
            'overflow-y:auto;border:1px solid #ddd;padding:0.5em">' + "".join(pieces) + "</div>")


def waiting_label(rag, strategy: str, sources) -> str:
    """What the page says while an answer's prefill runs, before its first token."""
    from ragblend.core.store.kv import KV_METADATA_KEY

    if strategy == FULL_PREFILL:
        return f"Computing a full prefill of {len(sources)} chunk(s)…"
    keys = [node.node.metadata.get(KV_METADATA_KEY) for node in sources]
    stored = sum(1 for key in keys if key and rag.engine.entries_stored(key))
    return f"Reading {stored} of {len(sources)} chunk(s) from the KV cache…"


def answer(rag, question: str, strategy: str, ratio: float, top_k: int, placeholder) -> dict:
    """Stream one answer into ``placeholder``, a waiting indicator there until its first token;
    return what the page shows about it."""
    query_engine = rag.query_engine(strategy=strategy, ratio=ratio, top_k=top_k, streaming=True, max_new_tokens=128)
    response = query_engine.query(question)   # retrieval; the prefill runs at the first token
    placeholder.status(waiting_label(rag, strategy, response.source_nodes), state="running")
    text = ""
    for delta in response.response_gen:
        text += delta
        placeholder.markdown(as_text(text + " ▌", lines=True), unsafe_allow_html=True)   # text, not Markdown
    placeholder.markdown(as_text(text, lines=True), unsafe_allow_html=True)
    stats, trace = query_engine.blend_llm.last_stats, rag.engine.last_prompt
    return {"text": text.strip(), "stats": stats, "trace": trace, "sources": response.source_nodes}


# ---------------------------------------------------------------------------- settings

files_root = os.environ.get("RAGBLEND_FILES_ROOT", "").strip() or None
with st.sidebar:
    st.header("Settings")
    # The operator's settings (ragblend app --index/--chroma-url, RAGBLEND_MODEL): a visitor
    # cannot point the app at another folder, model or server.
    model_path = os.environ.get("RAGBLEND_MODEL", "")
    index_dir = os.environ.get("RAGBLEND_INDEX_DIR", str(cache_dir() / "app-index"))
    chroma_url = os.environ.get("RAGBLEND_CHROMA_URL", "")
    collection = os.environ.get("RAGBLEND_CHROMA_COLLECTION") or "ragblend"
    st.text_input("Model path", value=model_path or "embedded SmolLM2-135M-Instruct", disabled=True,
                  help="Set by the operator: RAGBLEND_MODEL.")
    st.text_input("Index folder", value=index_dir, disabled=True, help="Set by the operator: ragblend app --index.")
    st.text_input("Chroma server URL", value=chroma_url or "the database in the index folder", disabled=True,
                  help="Set by the operator: ragblend app --chroma-url.")

try:
    rag = open_index(index_dir, model_path, chroma_url.strip(), collection)
except RagblendError as err:
    st.error(md(err))
    st.stop()

# The ratio the default strategy runs at: the model's calibrated one where it has one.
in_force = rag.engine.resolve()
in_force_ratio = in_force.ratio if isinstance(in_force.ratio, float) else None
calibrated = in_force.calibration_id is not None
with st.sidebar:
    strategy = st.selectbox("Strategy", list(STRATEGIES), format_func=STRATEGIES.get)
    takes_ratio = strategy != "default" and strategy_takes_ratio(strategy)   # the others recompute a fixed set
    # Its default is the ratio in force; under "default" it only shows it (the engine's choice runs).
    ratio = st.slider("Recompute ratio (QueryAware, CacheBlend)", 0.01, 1.0,
                      round(in_force_ratio or UNCALIBRATED.ratio, 2), 0.01, disabled=not takes_ratio)
    source = "calibrated for this model" if calibrated else "the default for an uncalibrated model"
    at_ratio = f" at ratio {in_force_ratio:.2f}" if in_force_ratio is not None else ""
    st.caption(f"In force by default: {type(in_force.strategy).__name__}{at_ratio}, {source}.")
    top_k = st.slider("Chunks to retrieve (top-k)", 1, 10, 4)
    compare = st.checkbox("Also answer with a full prefill", value=True)
history = st.session_state.setdefault("history", [])

st.title("ragblend")
st.caption("Retrieval-augmented generation that reuses each chunk's precomputed KV cache (CacheBlend).")

# ---------------------------------------------------------------------------- ingest

st.subheader("1. Ingest documents")
uploads = st.file_uploader("Upload documents (text, markdown, PDF, HTML, DOCX, CSV, JSON)", accept_multiple_files=True)
if files_root:
    folder = st.text_input(f"…or a file or folder on this machine, under {files_root}", key="folder",
                           placeholder=files_root)
else:
    folder = ""
    st.caption("Reading files on the server is off: the operator can allow a folder with "
               "`ragblend app --files-root DIR`.")
if st.button("Ingest", key="ingest"):
    from ragblend.integrations.local_index import IngestReport, path_under_root, read_text_files, read_uploads

    # Uploads are read in memory (nothing is written to disk: a refused one leaves nothing
    # behind); their ids name the index's uploads folder, so a re-upload replaces its chunks.
    documents, listing = read_uploads([(u.name, u.getvalue()) for u in uploads or []], Path(index_dir) / "uploads")
    refused = None
    if folder.strip():
        try:
            found, found_listing = read_text_files([path_under_root(folder, files_root)])
            documents += found
            listing.files += found_listing.files
            listing.skipped += found_listing.skipped
        except RagblendError as err:
            refused = str(err)
            st.error(md(refused))
    if not documents and not listing.skipped:
        if refused is None:
            st.warning("Choose files to upload" + (" or type a path" if files_root else "") + " first.")
    else:
        progress = st.progress(0.0, text="Ingesting…")
        new_chunks, done = 0, []
        try:
            for i, document in enumerate(documents, 1):
                report = rag.ingest_documents([document], IngestReport(), show_progress=False)
                new_chunks += report.nodes
                listing.skipped += report.skipped
                done += [document] if not report.skipped else []
                progress.progress(i / len(documents), text=f"Ingested {md(document.metadata['file_name'])} "
                                                            f"({i}/{len(documents)})")
        except RagblendError as err:   # another writer on the index, a damaged docstore
            st.error(md(err))
            done = []
        for path, reason in listing.skipped:
            st.warning(f"Skipped {md(Path(path).name)}: {md(reason)}")
        if done:
            st.success(f"Ingested {len(done)} file(s): {new_chunks} new or changed chunk(s), KV precomputed.")
        else:
            st.error("Nothing was ingested: no readable document among those given.")
coverage = rag.kv_coverage()   # how many chunks have their KV stored (the rest is computed by the questions using them)
filling = f", {rag.kv.state}" if rag.kv.running else ""
st.caption(f"The index in {index_dir} holds {len(rag)} chunk(s); {coverage.describe()}{filling}.")

# ---------------------------------------------------------------------------- ask

st.subheader("2. Ask")
question = st.text_input("Question", key="question", placeholder=load_sample()["demo"][0]["question"])
if st.button("Ask", key="ask"):
    if len(rag) == 0:
        st.info(f"The index is empty. Ingest documents first: upload files or type a folder above, "
                f"for instance the sample documents in {sample_dir()}.")
    elif not question.strip():
        st.warning("Type a question first.")
    else:
        # What the app times is fusion and full prefill: the prefix tier would serve the prompt the
        # warm-up just ran (ragblend.integrations.compare.fusion_only).
        with fusion_only():
            paths = (strategy, FULL_PREFILL) if compare else (strategy,)
            if not paths_are_warm(rag, paths):
                # Untimed, once per process and path, so that no timed answer pays the process's
                # one-off costs (ragblend.integrations.compare).
                with st.status("Warming up: one untimed token on each path, once per process…", state="running") as box:
                    warm_up(rag, question, paths, ratio=ratio if takes_ratio else None, top_k=top_k)
                    box.update(label="Warmed up (untimed).", state="complete")
            left, right = st.columns(2)
            with left:
                st.markdown(f"**ragblend: {STRATEGIES[strategy]}**")
                fused = answer(rag, question, strategy, ratio if takes_ratio else None, top_k, st.empty())
            full = None
            if compare:
                with right:
                    st.markdown("**Full prefill of the same prompt**")
                    full = answer(rag, question, FULL_PREFILL, None, top_k, st.empty())
        st.session_state["last"] = {"question": question, "fused": fused, "full": full}
        history.append({"query": f"Q{len(history) + 1}", "TTFT with fusion (s)": fused["stats"].ttft_s,
                        "TTFT full prefill (s)": full["stats"].ttft_s if full else None})

last = st.session_state.get("last")
if last:
    fused, full = last["fused"], last["full"]
    s = fused["stats"]
    cols = st.columns(4)
    speed = compare_stats(s, full["stats"]) if full else None
    # The delta is the TTFT's change: a minus (green) when fusion is faster, a plus (red) when slower.
    cols[0].metric("TTFT with fusion", f"{s.ttft_s:.2f} s", delta=f"{speed.ttft_change}: {speed.short}" if speed else None,
                   delta_color=speed.metric_color if speed else "normal")
    cols[1].metric("TTFT full prefill", f"{full['stats'].ttft_s:.2f} s" if full else "–")
    cols[2].metric("Prompt tokens reused", f"{s.reused_tokens} / {s.prompt_tokens}")
    cols[3].metric("Recomputed", f"{s.recomputed_tokens} ({s.recompute_fraction:.0%})")
    ran = s.strategy if s.ratio is None else f"{s.strategy} at ratio {s.ratio:g}"   # what ran, not what was asked
    compared = f"{speed.text.capitalize()}, each path warmed up once per process · " if speed else ""
    st.caption(f"{compared}Ran {ran} · KV load {s.load_s * 1000:.0f} ms · compute {s.compute_s * 1000:.0f} ms · "
               f"{s.chunks_reused} chunk(s) from the KV store {s.tiers} · {s.chunks_computed} computed now")
    if s.fusion_skipped:
        st.info("Ran as a full prefill: too few of the prompt's tokens are in cached chunks for fusion to save "
                f"work ({s.prompt_tokens} prompt tokens). {s.strategy_reason}")
    with st.expander("Retrieved chunks", expanded=True):
        from ragblend.integrations.local_index import printable
        from ragblend.vectorstore_hooks.llamaindex import llm_text

        trace = fused["trace"]
        recomputed = trace.recomputed.tolist()
        # each chunk found in the prompt: its tokens, and how many of them the fusion recomputed
        in_prompt = {sp.token_ids: (sp.end - sp.start, sum(recomputed[sp.start:sp.end])) for sp in trace.chunk_spans}
        for node in fused["sources"]:
            ids = tuple(rag.engine.prompts.tokenize(llm_text(node.node)))
            found, fresh = in_prompt.get(ids, (0, 0))
            status = (f"cached KV: {found - fresh} of {len(ids)} tokens reused, {fresh} recomputed" if found
                      else "computed as text")
            name = html.escape(printable(node.node.metadata.get("file_name", "?")))
            excerpt = html.escape(printable(" ".join(node.node.get_content().split())[:160]))
            # the document's name and text as text: an HTML block, which Markdown does not parse
            st.markdown(f"<div>• <b>{name}</b> (score {node.score:.2f}, {status}): {excerpt}…</div>",
                        unsafe_allow_html=True)
    with st.expander("Prompt: recomputed tokens highlighted"):
        st.caption("Yellow: chunk tokens recomputed (high KV deviation); grey: template and question, always "
                   "computed; plain: reused from the KV cache.")
        st.markdown(highlighted_prompt(rag.engine, fused["trace"]), unsafe_allow_html=True)

if history:
    st.subheader("TTFT over this session")
    st.bar_chart(history, x="query", y=["TTFT with fusion (s)", "TTFT full prefill (s)"], stack=False)
