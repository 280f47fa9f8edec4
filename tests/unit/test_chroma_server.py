"""LocalIndex and the CLI over a real Chroma server (`chroma run`, started by the test on 127.0.0.1)."""


import pytest

from ragblend import InvalidInputError
from ragblend.cli import main


@pytest.mark.parametrize("url, message", [
    ("http://127.0.0.1:9", "Cannot reach the Chroma server"),
    ("127.0.0.1:8000", "is not http[s]://host[:port]"),
    ("http://127.0.0.1:8000/path", "is not http[s]://host[:port]"),
    ("http://127.0.0.1:99999", "is not http[s]://host[:port]"),
])
def test_a_bad_chroma_url_fails_before_the_model_loads(url, message, tmp_path, capsys, monkeypatch):
    from ragblend import BlendEngine
    from ragblend.integrations.local_index import LocalIndex

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the Chroma URL was checked")

    monkeypatch.setattr(BlendEngine, "from_pretrained", no_model)
    with pytest.raises(InvalidInputError, match=message.replace("[", r"\[").replace("]", r"\]")):
        LocalIndex(tmp_path / "index", chroma_url=url)
    assert main(["ask", "anything", "--index", str(tmp_path / "index"), "--chroma-url", url]) == 2
    assert message in capsys.readouterr().err
