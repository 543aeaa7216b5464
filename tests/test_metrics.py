"""Scorers (RULER's string_match_all / part, the passkey containment) and the runner's per-subtask average."""

import pytest

from sparsekv.errors import SparseKVError
from sparsekv.eval import metrics
from sparsekv.eval.runner import RunSpec, run_grid
from sparsekv.eval.sample import Sample


def test_string_match_all_is_the_fraction_found_case_insensitive():
    refs = ["1234567", "Apple", "7654321"]
    assert metrics.string_match_all("the numbers are 1234567 and apple.", refs) == pytest.approx(2 / 3)
    assert metrics.string_match_all("  \x00APPLE 1234567 7654321\n", refs) == 1.0
    assert metrics.string_match_all("", refs) == 0.0


def test_string_match_part_is_any_found():
    assert metrics.string_match_part("Paris, France", ["paris", "lyon"]) == 1.0
    assert metrics.string_match_part("Berlin", ["paris", "lyon"]) == 0.0


def test_postprocess_replaces_control_characters():
    assert metrics.postprocess("  a\x07b\tc  ") == "a\nb\nc"


def test_unknown_metric_is_a_clear_error():
    with pytest.raises(SparseKVError, match="unknown metric 'bleu'"):
        metrics.score("bleu", "x", ["x"])


def test_runner_averages_subtasks_with_equal_weight(tiny):
    """Two subtasks of unequal size: the headline score is the mean of the two subtask scores (RULER's average),
    not the mean over samples; per_subtask carries each one's n, metric, nulls and template, and the cell's
    template lists each subtask's once."""
    ids = tiny.tokenizer("some context to read", add_special_tokens=False).input_ids
    never = "\x01never-generated\x02"  # references the tiny model cannot produce
    samples = [Sample(ids, [""], None, "t1", 2, "easy", "string_match_all"),  # "" is in every prediction
               Sample(ids, [never], None, "t2", 2, "hard", "string_match_all"),
               Sample(ids, [never], None, "t2", 2, "hard", "string_match_part"),
               Sample(ids, [never], None, "t2", 2, "hard", "string_match_all")]
    r = run_grid(tiny, "ruler", [RunSpec("dense", None)], 64, 1, samples=samples)[0]
    by = {p["subtask"]: p for p in r["per_subtask"]}
    assert by["easy"]["score"] == 100.0 and by["hard"]["score"] == 0.0 and by["hard"]["n"] == 3
    assert r["score"] == pytest.approx(50.0)  # (100 + 0) / 2, not 25
    assert r["per_depth"] == [] and all(s["subtask"] in ("easy", "hard") for s in r["samples"])
    assert [p["template"] for p in r["per_subtask"]] == ["t1", "t2"] and r["template"] == "t1 | t2"  # each once
