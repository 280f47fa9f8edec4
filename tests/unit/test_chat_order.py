"""A chat's messages reach the model in the order ``apply_chat_template`` renders them, through
BlendLLM.chat (LlamaIndex), BlendChatModel (LangChain) and the server's ChatPrompt alike (one
splitter: ragblend.core.chat_template.split_chat): an empty first system message stays the system
prompt (no template default in its place), a later system message keeps its place, and a template
refusing an order is a ragblend error, not a Jinja traceback."""

import copy
import re

import pytest

from ragblend.core.chat_template import split_chat
from ragblend.core.errors import InvalidInputError
from ragblend.serving.protocol import ApiError, ChatPrompt, TextLimit

from ..conftest import make_tiny_engine

# SmolLM2-135M-Instruct's template: a chat without a first system message gets its default one.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

# Gemma 3's instruction-tuned template (google/gemma-3-*-it, text part): the first system message
# is folded into the first user turn, any other order of roles is refused.
GEMMA3_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {{- message['content'] | trim }}
    {{- '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""

EMPTY_SYSTEM = [("system", ""), ("user", "Where does the ferry leave from?")]
MID_SYSTEM = [("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello."),
              ("system", "Answer in French from now on."), ("user", "Where does the ferry leave from?")]
TWO_SYSTEMS = [("system", "Be brief."), ("system", "Context: the ferry leaves from Pier 4."),
               ("user", "Where does the ferry leave from?")]


def _engine(tokenizer, template):
    with_template = copy.deepcopy(tokenizer)
    with_template.chat_template = template
    return make_tiny_engine("llama", with_template)


def _expected(engine, turns):
    return engine.tokenizer.apply_chat_template([{"role": r, "content": t} for r, t in turns],
                                                tokenize=True, add_generation_prompt=True, return_dict=False)


def _llamaindex_chat(engine, turns):
    pytest.importorskip("llama_index.core")
    from llama_index.core.llms import ChatMessage

    from ragblend import BlendLLM

    BlendLLM(engine=engine, max_new_tokens=1).chat([ChatMessage(role=r, content=t) for r, t in turns])
    return engine.last_prompt.token_ids


def _langchain_chat(engine, turns):
    pytest.importorskip("langchain_core")
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage

    from ragblend import BlendChatModel

    kinds = {"system": SystemMessage, "user": HumanMessage, "assistant": AIMessage}
    BlendChatModel(engine=engine, max_tokens=1).invoke([kinds[r](t) for r, t in turns])
    return engine.last_prompt.token_ids


def _served(engine, turns):
    prompt = ChatPrompt.parse([{"role": r, "content": t} for r, t in turns], TextLimit(engine))
    return prompt.layout(engine, find_chunks=False).token_ids


CHATS = {"llamaindex": _llamaindex_chat, "langchain": _langchain_chat, "server": _served}


def test_the_splitter_keeps_the_order_the_template_renders():
    assert split_chat(EMPTY_SYSTEM) == ("", [], "Where does the ferry leave from?")
    assert split_chat(MID_SYSTEM) == ("Be brief.", MID_SYSTEM[1:-1], MID_SYSTEM[-1][1])
    assert split_chat([("user", "Hi"), ("system", "Be brief."), ("user", "Bye")]) == (
        None, [("user", "Hi"), ("system", "Be brief.")], "Bye")
    for turns in ([], [("system", "Be brief.")], [("user", "Hi"), ("assistant", "Hello.")]):
        with pytest.raises(InvalidInputError, match="last message to be the user's"):
            split_chat(turns, "BlendLLM.chat")


@pytest.mark.parametrize("via", CHATS)
def test_an_empty_system_message_stays_and_keeps_the_default_out(tokenizer, via):
    engine = _engine(tokenizer, SMOLLM2_TEMPLATE)
    ids = CHATS[via](engine, EMPTY_SYSTEM)
    assert ids == _expected(engine, EMPTY_SYSTEM)
    assert "SmolLM" not in engine.tokenizer.decode(ids)


# The frameworks' opening system messages joined into one, as the library sends them.
JOINED_SYSTEMS = [("system", "Be brief.\n\nContext: the ferry leaves from Pier 4."), TWO_SYSTEMS[-1]]
LIBRARY = ("llamaindex", "langchain")


@pytest.mark.parametrize("via", CHATS)
def test_a_mid_chat_system_message_keeps_its_place(tokenizer, via):
    engine = _engine(tokenizer, SMOLLM2_TEMPLATE)
    assert CHATS[via](engine, MID_SYSTEM) == _expected(engine, MID_SYSTEM)
    opening = JOINED_SYSTEMS if via in LIBRARY else TWO_SYSTEMS   # the server renders what the client sent
    assert CHATS[via](engine, TWO_SYSTEMS) == _expected(engine, opening)


@pytest.mark.parametrize("via", CHATS)
def test_a_template_refusing_a_second_system_message_is_a_ragblend_error(tokenizer, via):
    """Gemma 3's template refuses a system turn after the first message. The library joins the
    opening system messages (LlamaIndex's context plus a memory's summary), so those still work;
    the server renders what the client sent; a system message in mid-chat is a clear error."""
    engine = _engine(tokenizer, GEMMA3_TEMPLATE)
    assert CHATS[via](engine, TWO_SYSTEMS[1:]) == _expected(engine, TWO_SYSTEMS[1:])   # one is fine
    if via in LIBRARY:
        assert CHATS[via](engine, TWO_SYSTEMS) == _expected(engine, JOINED_SYSTEMS)
    else:
        with pytest.raises(InvalidInputError, match=r"refused these turns \(system, system, user\).*alternate"):
            CHATS[via](engine, TWO_SYSTEMS)
    with pytest.raises(InvalidInputError, match=r"refused these turns \(system, user, assistant, system, user\)"):
        CHATS[via](engine, MID_SYSTEM)


def test_the_server_answers_a_chat_without_a_last_user_message_400(tokenizer):
    engine = make_tiny_engine("llama", tokenizer)
    with pytest.raises(ApiError, match="last message must be the user.s") as err:
        ChatPrompt.parse([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}],
                         TextLimit(engine))
    assert err.value.status == 400 and err.value.param == "messages"


def test_llamaindex_chat_engines_still_reach_the_model_as_their_turns(tokenizer):
    """The context and condense-plus-context engines send one system message (their context with
    their system prompt) before the history. BlendLLM's own system_prompt, which LlamaIndex would
    put before it as a second system message, joins it: Gemma 3's template, which refuses a second
    system message, answers them as well."""
    pytest.importorskip("llama_index.core")
    from llama_index.core import Document, VectorStoreIndex
    from llama_index.core.chat_engine import CondensePlusContextChatEngine, ContextChatEngine
    from llama_index.core.embeddings import MockEmbedding
    from llama_index.core.llms import ChatMessage

    from ragblend import BlendLLM

    index = VectorStoreIndex.from_documents([Document(text="The ferry leaves from Pier 4 at noon.")],
                                            embed_model=MockEmbedding(embed_dim=8))
    for kind in (CondensePlusContextChatEngine, ContextChatEngine):
        for template in (GEMMA3_TEMPLATE, SMOLLM2_TEMPLATE):
            engine = _engine(tokenizer, template)
            llm = BlendLLM(engine=engine, max_new_tokens=2, system_prompt="Speak plainly.")
            chat = kind.from_defaults(index.as_retriever(similarity_top_k=1), llm=llm, system_prompt="Be brief.")
            chat.chat("Where does the ferry leave from?")
            chat.chat("When?")
            assert llm.calls[-1].stats.generated_tokens > 0
            prompt = engine.tokenizer.decode(engine.last_prompt.token_ids)
            assert prompt.count("user\n") == 2 and prompt.count("system\n") <= 1, prompt
            assert prompt.index("Speak plainly.") < prompt.index("Pier 4") < prompt.index("Where does the ferry")
            assert "Be brief." in prompt
    # The field joins a chat's system prompt in BlendLLM.chat as well; it is the system prompt of one without.
    llm = BlendLLM(engine=_engine(tokenizer, SMOLLM2_TEMPLATE), max_new_tokens=1, system_prompt="Speak plainly.")
    llm.chat([ChatMessage(role="system", content="Be brief."), ChatMessage(role="user", content="Hi")])
    assert llm.engine.tokenizer.decode(llm.engine.last_prompt.token_ids).startswith(
        "<|im_start|>system\nSpeak plainly.\n\nBe brief.<|im_end|>\n<|im_start|>user\nHi")
    llm.chat([ChatMessage(role="user", content="Hi")])
    assert llm.engine.tokenizer.decode(llm.engine.last_prompt.token_ids).startswith(
        "<|im_start|>system\nSpeak plainly.<|im_end|>\n<|im_start|>user\nHi")


# Qwen2.5's way with a tool's result (its template, tool part): a user turn wrapped in <tool_response>.
TOOL_TEMPLATE = (
    "{%- for message in messages %}{%- if message.role == \"tool\" %}"
    "{{ '<|im_start|>user\n<tool_response>\n' + message.content + '\n</tool_response><|im_end|>\n' }}"
    "{%- else %}{{ '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif %}")
WITH_TOOL = [("user", "What is the weather in Lowenmark?"), ("assistant", "I asked the weather tool."),
             ("tool", "Sunny, 21 degrees."), ("user", "Shall I take the ferry?")]


def _llamaindex_tool_chat(engine, turns, calls=False):
    pytest.importorskip("llama_index.core")
    from llama_index.core.llms import ChatMessage, MessageRole

    from ragblend import BlendLLM

    roles = {"user": MessageRole.USER, "assistant": MessageRole.ASSISTANT, "tool": MessageRole.TOOL}
    messages = [ChatMessage(role=roles[r], content=t) for r, t in turns]
    if calls:   # as LlamaIndex's OpenAI LLM keeps a call
        messages[1].additional_kwargs["tool_calls"] = [{"id": "1", "type": "function",
                                                        "function": {"name": "weather", "arguments": "{}"}}]
    BlendLLM(engine=engine, max_new_tokens=1).chat(messages)
    return engine.last_prompt.token_ids


def _langchain_tool_chat(engine, turns, calls=False):
    pytest.importorskip("langchain_core")
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

    from ragblend import BlendChatModel

    kinds = {"user": HumanMessage, "assistant": AIMessage, "tool": lambda t: ToolMessage(t, tool_call_id="1")}
    messages = [kinds[r](t) for r, t in turns]
    if calls:
        messages[1] = AIMessage(turns[1][1], tool_calls=[{"name": "weather", "args": {}, "id": "1"}])
    BlendChatModel(engine=engine, max_tokens=1).invoke(messages)
    return engine.last_prompt.token_ids


TOOL_CHATS = {"llamaindex": _llamaindex_tool_chat, "langchain": _langchain_tool_chat}


@pytest.mark.parametrize("via", TOOL_CHATS)
def test_a_tools_result_takes_the_templates_tool_role(tokenizer, via):
    """A tool's result (LangChain's ToolMessage, LlamaIndex's TOOL role) is laid out as the
    template lays out a tool turn, never as the user's text."""
    engine = _engine(tokenizer, TOOL_TEMPLATE)
    ids = TOOL_CHATS[via](engine, WITH_TOOL)
    assert ids == _expected(engine, WITH_TOOL)
    assert "<tool_response>\nSunny, 21 degrees.\n</tool_response>" in engine.tokenizer.decode(ids)


@pytest.mark.parametrize("via", TOOL_CHATS)
def test_a_tools_result_without_a_tool_role_is_a_clear_error(tokenizer, via):
    """SmolLM2's template has no tool role (it would write ``<|im_start|>tool``, which its model
    never saw), and a plain layout has no roles: a clear error says to pass the result as text, naming
    the message as the integration's other message errors do (trial: it lacked "messages[i]")."""
    who = {"llamaindex": "BlendLLM.chat", "langchain": "BlendChatModel"}[via]
    for engine in (_engine(tokenizer, SMOLLM2_TEMPLATE), make_tiny_engine("llama", tokenizer, use_chat_template=False)):
        with pytest.raises(InvalidInputError, match=rf"^{re.escape(who)}: messages\[2\] is a tool's result, and the "
                                                    "model.* has no (tool role|chat template): give the tool's result "
                                                    "as text in a user message"):
            TOOL_CHATS[via](engine, WITH_TOOL)


@pytest.mark.parametrize("via", TOOL_CHATS)
def test_an_assistants_tool_call_is_a_clear_error(tokenizer, via):
    engine = _engine(tokenizer, TOOL_TEMPLATE)
    with pytest.raises(InvalidInputError, match=r"messages\[1\] is an assistant's call of the tool 'weather', "
                                                "and ragblend does not implement tool calling"):
        TOOL_CHATS[via](engine, WITH_TOOL, calls=True)


def test_the_splitter_refuses_a_last_tool_turn_and_unknown_roles():
    assert split_chat(WITH_TOOL) == (None, WITH_TOOL[:-1], WITH_TOOL[-1][1])
    with pytest.raises(InvalidInputError, match="ends with a tool's result.*as text in a user message"):
        split_chat(WITH_TOOL[:-1], "BlendLLM.chat")
    with pytest.raises(InvalidInputError, match="message 0 has the role 'narrator'"):
        split_chat([("narrator", "Once."), ("user", "Hi")], "BlendLLM.chat")


def test_bind_tools_is_refused_with_what_to_do(tokenizer):
    # A new user's trial: LangChain's base raised a bare NotImplementedError.
    pytest.importorskip("langchain_core")
    from ragblend import BlendChatModel

    def weather(city: str) -> str:
        """The weather in a city."""
        return "Sunny"

    chat = BlendChatModel(engine=_engine(tokenizer, TOOL_TEMPLATE))
    with pytest.raises(InvalidInputError, match="does not implement tool calling.*as text in a user message"):
        chat.bind_tools([weather])
