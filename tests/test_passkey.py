"""Passkey prompts hold their needle where they say, fit their length, and are scored by containment."""

from sparsekv.eval import passkey
from sparsekv.eval.runner import RunSpec, run_task


def test_samples_fit_and_hold_the_key_at_their_depth(tiny):
    samples = passkey.make_samples(tiny.tokenizer, 2400, 5, seed=1)
    assert [s.depth for s in samples] == [0.0, 0.25, 0.5, 0.75, 1.0]
    keys = {s.answer for s in samples}
    assert len(keys) == 5 and all(len(k) == 5 and k.isdigit() for k in keys)
    for s in samples:
        assert 2300 < len(s.ids) <= 2400
        text = tiny.tokenizer.decode(s.ids)
        assert text.count(s.answer) == 2  # "The pass key is K. Remember it. K is the pass key."
        assert text.rstrip().endswith(passkey.ANSWER_PREFIX)
        needle_at = text.index(passkey.NEEDLE.format(key=s.answer))
        at = text[:needle_at].count(passkey.FILLER) / text.count(passkey.FILLER)
        assert abs(at - s.depth) < 0.05


def test_same_seed_same_samples(tiny):
    a = passkey.make_samples(tiny.tokenizer, 400, 3, seed=7)
    b = passkey.make_samples(tiny.tokenizer, 400, 3, seed=7)
    c = passkey.make_samples(tiny.tokenizer, 400, 3, seed=8)
    assert [s.ids for s in a] == [s.ids for s in b] and [s.answer for s in a] != [s.answer for s in c]


def test_score_is_containment():
    from sparsekv.eval.metrics import score

    assert score("contains", " 12345. Remember it.", ["12345"]) == 1.0
    assert score("contains", " 1234", ["12345"]) == 0.0


def test_run_task_result_has_the_promised_fields(tiny):
    r = run_task(tiny, "passkey", RunSpec("streaming", 32), 300, 2)
    for key in ("task", "method", "budget", "seq_len", "n", "score", "selectivity", "model", "artifact",
                "per_depth", "metric", "protocol", "template", "dense_layers", "mean_sink", "mean_window"):
        assert key in r
    assert r["n"] == 2 and 0 <= r["score"] <= 100
    assert r["mean_sink"] == 4 and r["mean_window"] == 28 and r["selectivity"] < 0.15
    assert [d["depth"] for d in r["per_depth"]] == [0.0, 1.0]
