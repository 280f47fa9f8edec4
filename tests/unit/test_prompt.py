"""core.prompt: Chunk and segment checks, prompt layouts with their chunk spans, and the chunk
finder that marks known chunks in flat prompts. (Hostile template text: test_injection.py.)"""

import copy

import pytest

from ragblend import Chunk, InvalidInputError, PromptTooLongError, SegmentTypeError
from ragblend.core.prompt import PromptBuilder, check_segments

from ..conftest import PASSAGES


def test_chunk_finder_finds_whole_and_partial_chunks():
    from ragblend.core.prompt import ChunkFinder

    finder = ChunkFinder()
    a, b = tuple(range(100, 160)), tuple(range(500, 540))
    finder.add(a)
    finder.add(b)
    finder.add(range(7))  # too short to index
    prompt = [1, 2, 3] + list(a) + [9, 9] + list(b[5:30]) + [7] + list(b[:10])
    spans = finder.find(prompt)
    assert [(s.start, s.end, s.offset, s.token_ids) for s in spans] == [
        (3, 63, 0, a),           # whole chunk
        (65, 90, 5, b),          # a middle part of a chunk
    ]                            # a 10-token tail match is below MIN_RUN
    assert all(prompt[s.start:s.end] == list(s.token_ids[s.offset:s.offset + s.end - s.start]) for s in spans)
    assert finder.find([1, 2, 3]) == [] and len(finder) == 2


def test_chunk_finder_work_is_bounded_for_repeated_token_chunks():
    """Stored text is untrusted: chunks of one repeated token must not make matching quadratic."""
    from ragblend.core.prompt import ChunkFinder

    finder = ChunkFinder()
    for extra in range(200):
        finder.add([5] * (100 + extra))
    assert all(len(places) <= ChunkFinder.MAX_CHUNKS_PER_NGRAM for places in finder._index.values())
    spans = finder.find([5] * 20000)
    assert sum(s.end - s.start for s in spans) == 20000     # still reused, whole
    assert all(s.end - s.start <= 299 for s in spans)


def test_chunk_of_non_string():
    with pytest.raises(SegmentTypeError):
        Chunk(123)


def test_empty_chunk():
    with pytest.raises(InvalidInputError, match="Chunk text is empty"):
        Chunk("")


def test_a_layout_marks_each_chunk_where_its_own_tokens_sit(tokenizer):
    prompts = PromptBuilder(tokenizer)
    layout = prompts.build([Chunk(PASSAGES[0]), "Some fresh text.", Chunk(PASSAGES[1]), "Question?"], "Be brief.")
    assert len(layout.chunk_spans) == 2                  # plain str segments are no chunks
    for span, text in zip(layout.chunk_spans, PASSAGES):
        # A chunk's ids in the prompt are the ids it was precomputed with (tokenized alone).
        assert list(span.token_ids) == prompts.tokenize(text) == layout.token_ids[span.start:span.end]
    assert layout.chunk_spans[0].end < layout.chunk_spans[1].start


def test_check_segments_takes_one_segment_or_a_list_and_names_the_bad_one():
    assert check_segments("Q?") == ["Q?"] and check_segments(Chunk("a")) == [Chunk("a")]
    with pytest.raises(SegmentTypeError, match="segment 1 is a int"):
        check_segments([Chunk("a"), 5])
    with pytest.raises(InvalidInputError, match="segments is empty"):
        check_segments(())


WINDOW = 64   # a window the tests' tokenizer fills with ~30 words ("word " is two tokens)


def test_a_prompt_over_the_window_is_refused_with_the_tokens_it_holds(tokenizer):
    """Where every text was tokenized whole the refusal gives the prompt's tokens (what the
    builder lays out without a window); where a text after the one over the window was not
    tokenized, at least those counted; where only a bounded start of a text was, more than the
    window."""
    bounded, unbounded = PromptBuilder(tokenizer, max_tokens=WINDOW), PromptBuilder(tokenizer)
    words = "word " * 40   # 200 characters: under the first prefix, so tokenized whole
    for segments in ([words], [Chunk("The ferry crossed at dawn."), words]):
        n = len(unbounded.build(segments, "Be brief.").token_ids)
        with pytest.raises(PromptTooLongError, match=f"The prompt has {n} tokens; the model's context window "
                                                     f"holds {WINDOW}"):
            bounded.build(segments, "Be brief.")
    with pytest.raises(PromptTooLongError, match="The prompt has at least [0-9]+ tokens"):
        bounded.build([words, "Q?"])
    with pytest.raises(PromptTooLongError, match=f"The prompt has more than {WINDOW} tokens"):
        bounded.build(["\u4e00" * 3000])   # refused by its start: 3,000 characters are not tokenized
    prefix, suffix = unbounded.template_parts("Be brief. " * 12)
    with pytest.raises(PromptTooLongError, match=f"hold {len(prefix) + len(suffix)} tokens with the chat template"):
        bounded.build(["Q?"], "Be brief. " * 12)
    with pytest.raises(PromptTooLongError, match=f"hold more than {WINDOW} tokens"):
        bounded.build(["Q?"], history=[("user", "Be brief. " * 200), ("assistant", "Yes.")])


@pytest.mark.parametrize("chat", [True, False], ids=["chat template", "plain"])
def test_build_tokenizes_the_system_prompt_and_history_once(tokenizer, monkeypatch, chat):
    """Bounding the texts by the window (``max_tokens``) costs no second tokenizing of the system
    prompt and history: the template's pass counts them; the ids are those of a builder without
    a window."""
    system, asked, answered = "Be brief, sailor.", "Where does the ferry leave from?", "From the north pier."
    history = [("user", asked), ("assistant", answered)]
    segments = [Chunk(PASSAGES[0]), "When does it leave?"]
    expected = PromptBuilder(tokenizer, use_chat_template=chat).build(segments, system, history)
    builder, seen = PromptBuilder(tokenizer, use_chat_template=chat, max_tokens=2048), []
    for name in ("tokenize", "tokenize_template"):
        real = getattr(builder, name)
        monkeypatch.setattr(builder, name, lambda text, real=real: seen.append(text) or real(text))
    assert builder.build(segments, system, history) == expected
    for text in (system, asked, answered, PASSAGES[0]):
        assert sum(text in tokenized for tokenized in seen) == 1, (text, seen)


def templated(tokenizer, messages) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_a_long_chat_is_rendered_twice_and_a_trimming_template_still_gives_its_own_ids(tokenizer, monkeypatch):
    """Where the template writes every message as given, a chat of any length is rendered twice (with
    placeholders, then with the texts), not once more per message; where it changes a text (trims it),
    each message's text is what the template makes of it, as before: the ids are the template's."""
    history = [("user", " Where does the ferry leave from? "), ("assistant", "From the north pier.")] * 4
    messages = [{"role": role, "content": text} for role, text in [("system", "Be brief."), *history]]
    builder, renders = PromptBuilder(tokenizer), []
    real = builder._render
    monkeypatch.setattr(builder, "_render", lambda *args: renders.append(1) or real(*args))
    turns = [*messages, {"role": "user", "content": "When?"}]
    ids = builder.chat_ids(turns)
    assert len(renders) == 2 and ids == templated(tokenizer, turns)
    trimming = copy.deepcopy(tokenizer)
    trimming.chat_template = tokenizer.chat_template.replace("message['content']", "message['content'] | trim")
    assert "| trim" in trimming.chat_template
    renders.clear()
    builder = PromptBuilder(trimming)
    real = builder._render
    monkeypatch.setattr(builder, "_render", lambda *args: renders.append(1) or real(*args))
    assert builder.chat_ids(turns) == templated(trimming, turns)
    assert len(renders) > 2   # each message's own render: the template trims


def test_text_that_looks_like_a_placeholder_is_laid_out_as_text(tokenizer):
    """Each message is rendered as a random placeholder ("ragblend" and 32 hex digits) to find
    where its text goes; the same shape written by the template itself, or sent in a message,
    is ordinary text."""
    look_alike = "ragblend" + "0123456789abcdef" * 2
    odd = copy.deepcopy(tokenizer)
    odd.chat_template = tokenizer.chat_template.replace("message['content']", f"'{look_alike} ' + message['content']")
    assert look_alike in odd.chat_template
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"Is {look_alike} a name?"},
             {"role": "assistant", "content": look_alike}, {"role": "user", "content": "When?"}]
    for tok in (tokenizer, odd):
        assert PromptBuilder(tok).chat_ids(turns) == templated(tok, turns)


def test_a_repeated_prompt_is_laid_out_without_templating_or_tokenizing_again(tokenizer, monkeypatch):
    builder = PromptBuilder(tokenizer, max_tokens=2048)
    history = [("user", "Where does the ferry leave from?"), ("assistant", "From the north pier.")]
    segments = [Chunk(PASSAGES[0]), "When does it leave?"]
    first = builder.build(segments, "Be brief.", history, namespace="tenant-a")
    first.token_ids.append(7)   # a caller editing its layout changes no later one
    for name in ("tokenize", "tokenize_template", "template_parts"):
        monkeypatch.setattr(builder, name, lambda *a, **k: pytest.fail("tokenized again"))
    again = builder.build(list(segments), "Be brief.", [list(turn) for turn in history], namespace="tenant-a")
    assert again.token_ids == first.token_ids[:-1] and again.chunk_spans == first.chunk_spans
    assert again.namespace == "tenant-a" and again.conversation
    monkeypatch.undo()
    # any other input is laid out anew: another namespace (a tenant's own), system, or a str for a Chunk
    for other in (builder.build(segments, "Be brief.", history, namespace="tenant-b"),
                  builder.build(segments, "Be brief!", history, namespace="tenant-a"),
                  builder.build([PASSAGES[0], "When does it leave?"], "Be brief.", history, namespace="tenant-a")):
        assert other != again
    assert builder.build(segments, "Be brief.", history, namespace="tenant-b").namespace == "tenant-b"


def test_a_template_that_writes_the_date_is_templated_again_on_every_prompt(tokenizer):
    """A remembered layout would keep the first call's date (Llama 3's templates call strftime_now):
    such a template is never remembered; another tenant's layout is its own too."""
    import copy
    from unittest import mock

    dated = copy.deepcopy(tokenizer)
    dated.chat_template = ("{{ '<|im_start|>system\\nToday: ' + strftime_now('%S.%f') + '<|im_end|>\\n' }}"
                           "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
                           "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    builder = PromptBuilder(dated, max_tokens=2048)
    with mock.patch.object(builder, "_build", wraps=builder._build) as build:
        builder.build([Chunk("The ferry leaves at noon."), "When does it leave?"])
        builder.build([Chunk("The ferry leaves at noon."), "When does it leave?"])
    assert build.call_count == 2
    plain = PromptBuilder(tokenizer, max_tokens=2048)
    with mock.patch.object(plain, "_build", wraps=plain._build) as build:
        for namespace in ("a", "a", "b"):
            plain.build(["When does it leave?"], namespace=namespace)
    assert build.call_count == 2   # a's repeat remembered, b's laid out again


def test_a_template_that_refuses_the_turns_is_a_clear_error(tokenizer):
    """Gemma's template, for one, raises on a system message after the first: that is the caller's
    input to mend (the server answers 400), not a crash."""
    strict = copy.deepcopy(tokenizer)
    strict.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
                            "{{ raise_exception('System role only first') }}{% endif %}"
                            "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    builder = PromptBuilder(strict)
    with pytest.raises(InvalidInputError, match=r"refused these turns \(user, assistant, system, user\)"):
        builder.template_parts(None, [("user", "Hi"), ("assistant", "Hello."), ("system", "In French.")])
    assert builder.template_parts("Be brief.", [("user", "Hi")])   # a first system message is fine


def test_the_next_turn_opening_is_what_the_template_writes_after_an_answer(tokenizer):
    """What every next turn of a chat starts with after an answer's text (computed ahead by the
    prefix tier): ChatML's closing of the answer and opening of the user turn; the plain layout's
    separator; nothing where the template refuses a chat with an answer."""
    builder = PromptBuilder(tokenizer)
    opening = builder.next_turn_opening()
    assert opening == builder.tokenize_template("<|im_end|>\n<|im_start|>user\n")
    ids = builder.chat_ids([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."},
                            {"role": "user", "content": "When does it leave?"}])
    answer_end = len(builder.chat_ids([{"role": "user", "content": "Hi"}])) + len(builder.tokenize("Hello there."))
    assert ids[answer_end:answer_end + len(opening)] == opening
    assert PromptBuilder(tokenizer, use_chat_template=False).next_turn_opening() == builder.tokenize("\n\n")
    refusing = copy.deepcopy(tokenizer)
    refusing.chat_template = ("{% for m in messages %}{% if m['role'] == 'assistant' %}"
                              "{{ raise_exception('no assistant turns') }}{% endif %}"
                              "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}")
    assert PromptBuilder(refusing).next_turn_opening() == []
