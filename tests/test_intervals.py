"""Bootstrap intervals of generation scores: stratified by subtask, paired between cells of one run."""

import pytest

from sparsekv.eval.intervals import annotate, difference, score_interval


def rows(scores, subtask=None):
    return [{"score": s, "subtask": subtask} for s in scores]


def test_interval_brackets_the_score_and_narrows_with_more_prompts():
    few, many = rows([1, 0] * 10), rows([1, 0] * 200)
    lo, hi = score_interval(few)
    assert lo < 50 < hi and hi - lo > 30
    lo2, hi2 = score_interval(many)
    assert lo2 < 50 < hi2 and hi2 - lo2 < 0.4 * (hi - lo)
    assert score_interval(rows([1] * 30)) == [100.0, 100.0]
    assert score_interval(few) == [lo, hi]  # seeded: the same data, the same interval


def test_strata_weigh_equally_as_rulers_average():
    # subtask a: all right (10 prompts), b: all wrong (2 prompts): RULER's score is 50 whatever the counts
    r = rows([1] * 10, "a") + rows([0] * 2, "b")
    assert score_interval(r) == [50.0, 50.0]


def test_paired_difference():
    a = rows([1, 1, 0, 1] * 25)
    assert difference(a, a) == {"delta": 0.0, "ci95": [0.0, 0.0]}
    b = rows([1, 0, 0, 1] * 25)  # one prompt in four lost
    d = difference(b, a)
    assert d["delta"] == pytest.approx(-25.0) and d["ci95"][0] < -25 < d["ci95"][1] < 0


def test_annotate_compares_with_dense_and_the_oracle_at_the_same_budget():
    cell = lambda method, budget, s: {"method": method, "budget": budget, "seq_len": 100, "samples": rows(s)}
    res = annotate([cell("dense", None, [1] * 20), cell("oracle", 64, [1] * 10 + [0] * 10),
                    cell("oracle", 128, [1] * 20), cell("spotlight", 64, [1] * 5 + [0] * 15)])
    spot = res[3]
    assert spot["vs_dense"]["delta"] == pytest.approx(-75.0) and spot["vs_oracle"]["delta"] == pytest.approx(-25.0)
    assert "vs_oracle" not in res[1] and res[1]["vs_dense"]["delta"] == pytest.approx(-50.0)
    assert "vs_dense" not in res[0] and all("score_ci95" in r for r in res)
