"""`ragblend cache stats --model M` counts M's KV of the index's chunks, not the ingesting model's."""

import pytest

pytest.importorskip("llama_index.core")

from ragblend import BlendEngine  # noqa: E402
from ragblend.cli import main  # noqa: E402

from ..conftest import tiny_model  # noqa: E402
from .test_ingest_background import paragraph  # noqa: E402


def saved_model(folder, arch, tokenizer):
    import copy

    copy.deepcopy(tiny_model(arch)).save_pretrained(folder)   # (saving sets its config's architectures)
    tokenizer.save_pretrained(folder)
    return str(folder)


def test_cache_stats_with_model_counts_that_models_entries(tmp_path, tokenizer, capsys):
    # Issue 55: `cache stats --model M` counted the keys the index recorded at ingest (the ingesting
    # model's), so it said "KV for 8 of 8 chunks" for a model that had none of them.
    from ragblend.integrations.local_index import LocalIndex
    from ragblend.vectorstore_hooks.llamaindex import llm_text

    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(8):
        (docs / f"{i:02d}.md").write_text(paragraph(i))
    ingesting, other = saved_model(tmp_path / "llama", "llama", tokenizer), saved_model(tmp_path / "qwen", "qwen2",
                                                                                        tokenizer)
    index = tmp_path / "index"
    engine = BlendEngine.from_pretrained(ingesting, kv_dir=index / "kv")
    rag = LocalIndex(index, engine=engine)
    rag.ingest([docs], show_progress=False, kv="now")
    texts = [llm_text(node) for node in rag.vector_store.get_nodes()]
    assert len(texts) == 8
    second = BlendEngine.from_pretrained(other, kv_dir=index / "kv")
    second.precompute(texts[:3])   # the other model has the KV of 3 chunks of the index, with their lead entries
    second.precompute(texts[3:5])
    second.store.delete(second.lead_key(second.key_of(texts[4])))   # and 1 more without its lead entry
    engine.store.disk.close()
    second.store.disk.close()

    def stats(*flags) -> str:
        assert main(["cache", "stats", "--index", str(index), *flags]) == 0
        return capsys.readouterr().out

    recorded = stats()   # no model: the keys the index recorded (the ingesting model's)
    assert "KV for 8 of 8 chunk(s)" in recorded and "the engine that ingested the index" in recorded
    out = stats("--model", other)
    assert "KV for 5 of 8 chunk(s) (62.5%), 3 to compute; 1 without their lead entry" in out
    assert "(8 keyed apart from the keys the index recorded" in out and f"--model {other} names" in out
    assert "KV for 8 chunks:" in out and "2 entries of ~" in out   # projected from the model's shape
    same = stats("--model", ingesting)   # the ingesting model itself: its keys are the recorded ones
    assert "KV for 8 of 8 chunk(s) (100.0%), 0 to compute" in same and "keyed apart" not in same
    int8 = stats("--model", ingesting, "--kv-dtype", "int8")   # another stored dtype is other entries
    assert "KV for 0 of 8 chunk(s)" in int8 and "(8 keyed apart from the keys the index recorded" in int8
    # --disk-bytes on `cache stats` projects at that size and says the store keeps its own (a trial's
    # confusion: the limit line and the projection disagreed); the saved limit is not changed.
    from ragblend.core.store.disk_limit import saved_limit

    before = saved_limit(index / "kv")
    small = stats("--disk-bytes", "100KiB")
    assert "(--disk-bytes 100 KiB: the projection below is at that size; the store keeps its" in small
    assert saved_limit(index / "kv") == before
