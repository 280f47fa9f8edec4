"""`ragblend ask/ingest/serve --help` says every option's default, and `ask --sources` prints the
retrieved chunks (issues from a new-user trial, session 45)."""

import argparse

import pytest

from ragblend.cli import build_parser


def _subparser(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices[name]


@pytest.mark.parametrize("command", ["ask", "ingest", "serve"])
def test_every_option_has_a_help_text_with_its_default(command):
    parser = _subparser(command)
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help, f"{command} {action.dest} has no help text"
        flag_only = isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))
        if action.option_strings and not flag_only:
            assert "default" in action.help, f"{command} {action.option_strings[0]} does not say its default"
    text = parser.format_help()
    if command == "ask":   # the two a trial missed, with their values
        assert "(default: 4)" in text and "(default: 128)" in text


def test_ask_sources_prints_each_retrieved_chunk_with_its_file_score_and_start(capsys):
    pytest.importorskip("llama_index.core")
    from llama_index.core.schema import NodeWithScore, TextNode

    from ragblend.cli.ask import print_sources

    long_text = "The Kite Festival began in 1987 on the dunes north of Lowenmark,\n" + "and the wind " * 20
    nodes = [NodeWithScore(node=TextNode(text=long_text, metadata={"file_name": "kites.md"}), score=0.8123),
             NodeWithScore(node=TextNode(text="A short one."), score=None)]
    print_sources(nodes)
    out = capsys.readouterr().out
    assert "Sources (2 retrieved chunks, best first):" in out
    first = next(line for line in out.splitlines() if line.startswith("  1."))
    assert first.startswith("  1. kites.md (score 0.81): The Kite Festival began in 1987 on the dunes north of "
                            "Lowenmark, and the wind") and first.endswith("...")
    assert len(first.split(": ", 1)[1]) <= 103
    assert "  2. " in out and "A short one." in out
    args = build_parser().parse_args(["ask", "q", "--show-sources"])
    assert args.sources and build_parser().parse_args(["ask", "q", "--sources"]).sources


def test_ask_sources_escapes_what_would_drive_the_terminal(capsys):
    # Review 45: a hostile file name or text reached the terminal raw (escape sequences, bidi overrides).
    pytest.importorskip("llama_index.core")
    from llama_index.core.schema import NodeWithScore, TextNode

    from ragblend.cli.ask import print_sources

    hostile = TextNode(text="\x1b[2J\x1b]0;pwned\x07 clear \u202e", metadata={"file_name": "a\x1b[31m.txt"})
    print_sources([NodeWithScore(node=hostile, score=0.5)])
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "\u202e" not in out
    assert "a\\x1b[31m.txt" in out
