"""LangChain: BlendChatModel against the langchain-tests standard suites, the vector-store
ingestion hook, and a stuff-documents RAG chain on a real Chroma store."""

import pytest

pytest.importorskip("langchain_core")
langchain_tests = pytest.importorskip("langchain_tests")

from langchain_tests.integration_tests import ChatModelIntegrationTests  # noqa: E402
from langchain_tests.unit_tests import ChatModelUnitTests  # noqa: E402

from langchain_core.messages import AIMessage, HumanMessage  # noqa: E402

from ragblend import BlendChatModel, BlendEngine  # noqa: E402

_ENGINE = None


def shared_engine():
    """One engine (KV in a temp dir) for the many model instances the suites create."""
    global _ENGINE
    if _ENGINE is None:
        import tempfile

        _ENGINE = BlendEngine.from_pretrained(kv_dir=tempfile.mkdtemp(prefix="ragblend-lc-kv-"))
    return _ENGINE


PASSAGE = ("The Sanderling is a small passenger ferry that crosses from the north pier of Lowenmark "
           "to the island of Hallow Holm four times a day in summer and twice a day in winter.")


class TestBlendChatModelUnit(ChatModelUnitTests):
    """The standard unit tests. Constructing the model never loads it."""

    @property
    def chat_model_class(self):
        return BlendChatModel

    @property
    def chat_model_params(self):
        return {"temperature": 0.0}

    @property
    def supports_model_override(self):
        return False  # one local model per instance


NOT_APPLICABLE = "not applicable to a local text-only model without tool calling or structured output"


@pytest.mark.slow
class TestBlendChatModelIntegration(ChatModelIntegrationTests):
    """The standard integration tests on the real default model (SmolLM2-135M-Instruct).

    Not applicable, and so switched off through the suite's own capability flags: tool
    calling (and everything built on it: tool choice, tool messages, agent loops, runnables
    as tools), structured output and JSON mode, image / audio / video / PDF inputs, Anthropic
    message formats, per-call model override, and VCR-recorded network timing.
    """

    @property
    def chat_model_class(self):
        return BlendChatModel

    @property
    def chat_model_params(self):
        return {"temperature": 0.0, "engine": shared_engine()}

    @property
    def standard_chat_model_params(self):
        return {**super().standard_chat_model_params, "max_tokens": 24}

    @property
    def has_tool_calling(self):
        return False

    @property
    def has_structured_output(self):
        return False

    @property
    def supports_json_mode(self):
        return False

    @property
    def supports_model_override(self):
        return False

    @property
    def returns_usage_metadata(self):
        return True

    @property
    def supported_usage_metadata_details(self):
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}

    def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
        model = BlendChatModel(engine=shared_engine(), max_tokens=16)
        message = HumanMessage(content=[
            {"type": "text", "text": PASSAGE, "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "Which ferry goes to Hallow Holm?"},
        ])
        if not stream:
            reply = model.invoke([message])
        else:
            reply = None
            for chunk in model.stream([message]):
                reply = chunk if reply is None else reply + chunk
        assert reply.usage_metadata["input_token_details"]["cache_read"] > 0
        return reply
