"""The benchmark helpers that need no download: SQuAD metrics and model names."""

import pytest

from benchmarks.models import model_path
from benchmarks.run import rouge_l
from benchmarks.squad import (answer_contained, best_over_answers, exact_match, extract_answer, f1_score,
                              normalize_answer)


def test_squad_normalisation_and_scores():
    assert normalize_answer("The  Rollo, of Normandy!") == "rollo of normandy"
    assert exact_match("the Rollo.", "Rollo") == 1.0 and exact_match("Rollo the Walker", "Rollo") == 0.0
    assert f1_score("Super Bowl LI", "Super Bowl LI") == 1.0
    assert f1_score("peat swamps", "peat swamps or small ponds") == pytest.approx(2 * 1 * 0.4 / 1.4)
    assert f1_score("nothing alike", "Rollo") == 0.0
    assert best_over_answers(exact_match, "In 999", ["999", "In 999"]) == 1.0


def test_answer_extraction_and_containment():
    assert extract_answer("\n  Answer: The Broncos won. They beat the Panthers.\nmore") == "The Broncos won."
    assert extract_answer("Rollo") == "Rollo" and extract_answer("") == ""
    assert answer_contained("The Denver Broncos won Super Bowl 50.", "Denver Broncos") == 1.0
    assert answer_contained("Denverite fans", "Denver") == 0.0  # whole words only
    assert answer_contained("anything", "the") == 0.0  # an answer that normalises to nothing never matches


def test_model_names():
    assert model_path("smollm2") is None
    with pytest.raises(ValueError, match="smollm2"):
        model_path("gpt-5")


def test_rouge_l():
    assert rouge_l("the ferry is the Sanderling", "the ferry is the Sanderling") == 1.0
    assert rouge_l("", "") == 1.0 and rouge_l("a", "") == 0.0 and rouge_l("x y", "a b") == 0.0
    # LCS "the Sanderling" (2 of 3 candidate tokens, 2 of 4 reference tokens)
    assert rouge_l("the Sanderling ferry", "it is the Sanderling") == pytest.approx(2 * (2 / 3) * 0.5 / (2 / 3 + 0.5))
