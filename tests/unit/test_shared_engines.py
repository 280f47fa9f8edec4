"""BlendLLM and BlendChatModel built from the same model and engine options share one engine in
the process (ragblend.integrations.shared_engines), loaded once even when asked for from several
threads at once, and freed once nothing holds it."""

import gc
import weakref
from concurrent.futures import ThreadPoolExecutor

import pytest

from ragblend import BlendEngine

from ..conftest import tiny_model

pytest.importorskip("llama_index.core")
pytest.importorskip("langchain_core")

from ragblend import BlendChatModel, BlendLLM  # noqa: E402
from ragblend.integrations.shared_engines import loaded_engines, pending_loads  # noqa: E402


@pytest.fixture
def model_dir(tokenizer, tmp_path):
    tiny_model("llama").save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    return tmp_path / "model"


@pytest.fixture
def loads(monkeypatch):
    """The models BlendEngine.from_pretrained loaded in this test (each still loaded for real)."""
    loaded = []
    load = BlendEngine.from_pretrained.__func__

    def counted(cls, *args, **kwargs):
        loaded.append(kwargs.get("options"))
        return load(cls, *args, **kwargs)
    monkeypatch.setattr(BlendEngine, "from_pretrained", classmethod(counted))
    return loaded


def test_one_model_is_loaded_once_for_every_integration(model_dir, tmp_path, loads, monkeypatch):
    kv = str(tmp_path / "kv")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "link").symlink_to(model_dir, target_is_directory=True)
    owners = [BlendLLM(model_path=str(model_dir), kv_dir=kv, max_new_tokens=2),
              BlendLLM(model_path="model", kv_dir=kv, temperature=0.7, max_new_tokens=2),   # the same path, relative
              BlendChatModel(model_path=str(model_dir), kv_dir=kv, max_tokens=2),
              BlendLLM(model_path="~/model", kv_dir="~/kv", max_new_tokens=2),          # from the home folder
              BlendChatModel(model_path=str(tmp_path / "link"), kv_dir=kv, max_tokens=2)]   # through a link
    with ThreadPoolExecutor(len(owners)) as pool:   # all at once: the second and third wait for the first load
        engines = list(pool.map(lambda owner: owner.engine, owners))
    assert len(loads) == 1 and all(engine is engines[0] for engine in engines)
    # answered through the shared engine, each with its own settings and stats
    assert owners[0].complete("Hi").text is not None and owners[2].invoke("Hi").content is not None
    assert owners[0].calls[-1].stats.generated_tokens > 0
    # other engine options are another engine
    assert BlendChatModel(model_path=str(model_dir), kv_dir=kv, kv_dtype="int8").engine is not engines[0]
    assert len(loads) == 2
    assert pending_loads() == 0   # no load lock kept once the loads are done


def test_equivalent_options_are_one_key():
    import torch

    from ragblend.core.model.loading import default_gguf_path
    from ragblend.core.options import EngineOptions
    from ragblend.integrations.shared_engines import _key

    assert _key(EngineOptions(dtype=None)) == _key(EngineOptions(dtype="auto"))   # both the default form
    assert _key(EngineOptions(dtype=torch.bfloat16)) == _key(EngineOptions(dtype="bfloat16"))
    assert _key(EngineOptions(kv_dtype=torch.float16)) == _key(EngineOptions(kv_dtype="float16"))
    assert _key(EngineOptions(dtype="float32")) != _key(EngineOptions(dtype="auto"))
    # the default model, named by its own file
    assert _key(EngineOptions(model=None)) == _key(EngineOptions(model=str(default_gguf_path())))
    assert _key(EngineOptions(kv_dir=False)).kv_dir is False


def test_a_failed_load_keeps_no_lock(tmp_path):
    from ragblend.core.errors import RagblendError
    from ragblend.core.options import EngineOptions
    from ragblend.integrations.shared_engines import shared_engine

    for i in range(3):   # distinct models, none loadable: each key's lock goes with its load
        with pytest.raises(RagblendError):
            shared_engine(EngineOptions(model=str(tmp_path / f"missing-{i}"), kv_dir=False))
    assert pending_loads() == 0


def test_an_engine_nobody_holds_is_freed(model_dir, tmp_path, loads):
    llm = BlendLLM(model_path=str(model_dir), kv_dir=str(tmp_path / "kv"), max_new_tokens=2)
    llm.complete("Hi")
    engine = weakref.ref(llm.engine)
    assert engine() in loaded_engines()
    del llm
    gc.collect()
    assert engine() is None and len(loads) == 1
    assert BlendLLM(model_path=str(model_dir), kv_dir=str(tmp_path / "kv")).engine is not None and len(loads) == 2
