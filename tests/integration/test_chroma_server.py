"""LocalIndex and the CLI over a real Chroma server (`chroma run`, started by the test on 127.0.0.1)
and the real default model; the bad-URL checks are in tests/unit/test_chroma_server.py."""

import subprocess
import sys
from pathlib import Path

import pytest

from ragblend.cli import main
from tests.servers import ServerProcess, free_port


@pytest.fixture(scope="module")
def chroma_url(tmp_path_factory):
    import chromadb

    chroma = Path(sys.executable).with_name("chroma")
    if not chroma.exists():
        pytest.skip("the `chroma` command (chromadb's server) is not installed")
    port = free_port()
    folder = tmp_path_factory.mktemp("chroma-server")
    with ServerProcess([str(chroma), "run", "--path", str(folder), "--host", "127.0.0.1", "--port", str(port)],
                       lambda: chromadb.HttpClient(host="127.0.0.1", port=port).heartbeat(), f"chroma run on port {port}",
                       timeout_s=60, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL):
        yield f"http://127.0.0.1:{port}"


@pytest.mark.slow
def test_local_index_over_a_chroma_server(chroma_url, smol_engine, tmp_path):
    import chromadb

    from ragblend.data import sample_dir
    from ragblend.integrations.local_index import LocalIndex

    rag = LocalIndex(tmp_path / "index", engine=smol_engine, chroma_url=chroma_url, collection="server-test")
    report = rag.ingest([sample_dir()], show_progress=False)
    assert len(report.files) == 6 and len(rag) == report.nodes > 0
    server_side = chromadb.HttpClient(host="127.0.0.1", port=int(chroma_url.rsplit(":", 1)[1]))
    assert server_side.get_collection("server-test").count() == report.nodes   # the vectors live on the server
    assert not (tmp_path / "index" / "chroma").exists()                        # not in the index folder
    # The water plan's date, not the kite festival's year: the 135M model's fused answer to that
    # one flips between two years of its passage with the ratio (docs/notes/lead-entries.md).
    answer = rag.ask("On what date did the municipal council adopt the Lowenmark Water Management Plan?",
                     max_new_tokens=24)
    assert "11 June 2024" in answer.text
    assert answer.stats.reused_tokens > 0.5 * answer.stats.prompt_tokens


@pytest.mark.slow
def test_cli_ingest_and_ask_over_a_chroma_server(chroma_url, tmp_path, capsys, monkeypatch):
    import chromadb

    from ragblend.data import sample_dir

    monkeypatch.setenv("RAGBLEND_CHROMA_URL", chroma_url)   # the environment variable, as a deployment sets it
    monkeypatch.setenv("RAGBLEND_CHROMA_COLLECTION", "cli-test")   # this index's own collection on the server
    index = str(tmp_path / "index")
    assert main(["ingest", str(Path(sample_dir()) / "06-water-plan.md"), "--index", index]) == 0
    assert main(["ask", "On what date did the municipal council adopt the Lowenmark Water Management Plan?",
                 "--index", index, "--max-new-tokens", "24"]) == 0
    out = capsys.readouterr().out
    assert "11 June 2024" in out
    assert not (tmp_path / "index" / "chroma").exists()
    server_side = chromadb.HttpClient(host="127.0.0.1", port=int(chroma_url.rsplit(":", 1)[1]))
    assert server_side.get_collection("cli-test").count() > 0
    assert main(["cache", "stats", "--index", index]) == 0   # finds the index's chunks in its collection
    assert "index:       KV for" in capsys.readouterr().out


@pytest.mark.slow
def test_two_index_folders_on_one_collection_are_warned_about(chroma_url, smol_engine, tmp_path, caplog):
    from ragblend.integrations.local_index import LocalIndex

    LocalIndex(tmp_path / "first", engine=smol_engine, chroma_url=chroma_url, collection="shared")
    LocalIndex(tmp_path / "first", engine=smol_engine, chroma_url=chroma_url, collection="shared")   # its own
    assert "belongs to the index at" not in caplog.text
    LocalIndex(tmp_path / "second", engine=smol_engine, chroma_url=chroma_url, collection="own")
    assert "belongs to the index at" not in caplog.text
    LocalIndex(tmp_path / "second", engine=smol_engine, chroma_url=chroma_url, collection="shared")
    assert f"belongs to the index at {(tmp_path / 'first').resolve()}" in caplog.text and "--collection" in caplog.text
    # a moved folder takes its collection along, without a warning
    caplog.clear()
    (tmp_path / "first").rename(tmp_path / "moved")
    LocalIndex(tmp_path / "moved", engine=smol_engine, chroma_url=chroma_url, collection="shared")
    LocalIndex(tmp_path / "moved", engine=smol_engine, chroma_url=chroma_url, collection="shared")
    assert "belongs to the index at" not in caplog.text


@pytest.mark.slow
def test_two_folders_stamping_one_collection_at_once_warn_the_one_whose_stamp_was_overwritten(
        chroma_url, smol_engine, tmp_path, caplog, monkeypatch):
    import chromadb
    from chromadb.api.models.Collection import Collection

    from ragblend.integrations.local_index import OWNER_KEY, LocalIndex

    server_side = chromadb.HttpClient(host="127.0.0.1", port=int(chroma_url.rsplit(":", 1)[1]))
    other = tmp_path / "other"
    other.mkdir()
    modify = Collection.modify

    def raced(collection, *args, **kwargs):   # both saw it unclaimed; the other folder's stamp lands last
        modify(collection, *args, **kwargs)
        modify(server_side.get_collection("raced"), metadata={OWNER_KEY: str(other.resolve())})

    monkeypatch.setattr(Collection, "modify", raced)
    LocalIndex(tmp_path / "index", engine=smol_engine, chroma_url=chroma_url, collection="raced")
    assert f"belongs to the index at {other.resolve()}" in caplog.text


@pytest.mark.slow
def test_a_cosine_collection_made_elsewhere_opens_and_keeps_its_distance(chroma_url, smol_engine, tmp_path):
    import chromadb

    from ragblend.integrations.local_index import OWNER_KEY, LocalIndex

    server_side = chromadb.HttpClient(host="127.0.0.1", port=int(chroma_url.rsplit(":", 1)[1]))
    server_side.create_collection("cosine-docs", metadata={"hnsw:space": "cosine"})
    rag = LocalIndex(tmp_path / "index", engine=smol_engine, chroma_url=chroma_url, collection="cosine-docs")
    collection = server_side.get_collection("cosine-docs")
    assert collection.metadata[OWNER_KEY] == str((tmp_path / "index").resolve()) and len(rag) == 0
    assert collection.configuration_json["hnsw"]["space"] == "cosine"
    server_side.create_collection("odd-stamp", metadata={OWNER_KEY: 7})   # a stamp that is not a folder's path
    LocalIndex(tmp_path / "index", engine=smol_engine, chroma_url=chroma_url, collection="odd-stamp")
    assert server_side.get_collection("odd-stamp").metadata[OWNER_KEY] == str((tmp_path / "index").resolve())
