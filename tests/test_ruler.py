"""RULER task generators: prompts hold their answers, fill seq_len, follow RULER's templates, are seeded, and the
qa subtasks are skipped with a reason when their datasets cannot be loaded. No real model is needed."""

import collections
import gzip
import itertools
import random
import re

import pytest

from sparsekv.errors import SparseKVError
from sparsekv.eval import metrics
from sparsekv.eval.ruler import DEFAULT_SUBTASKS, SUBTASKS, make_samples, resolve_subtasks, skipped_subtasks
from sparsekv.eval.ruler import qa as ruler_qa
from sparsekv.eval.ruler.fit import largest_fitting
from sparsekv.eval.ruler.haystack import NOISE, load_essay, split_sentences
from sparsekv.models import byte_tokenizer

SYNTHETIC = [s for s in SUBTASKS if not s.startswith("qa_")]
GEN = {"niah": 128, "vt": 30, "cwe": 120, "fwe": 50, "qa": 32}

ESSAY = ("Hackers solve problems and build things. They believe in freedom and voluntary mutual help! Is that all? "
         "No: the culture values competence (above all else.) \"Real programmers\" write code at 3 in the morning. "
         "A kludge is an ugly fix, e.g. one held together with tape. Some people call it a hack. The jargon grew "
         "out of MIT, Stanford and CMU in the sixties and seventies. Words like foo and bar name nothing at all. ")


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def chat_tok():
    """The byte tokenizer with a small chat template, so prompts go through apply_chat_template."""
    t = byte_tokenizer()
    t.chat_template = ("{% for m in messages %}<|user|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
                       "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    return t


@pytest.fixture(scope="module")
def essay_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("hay") / "essay.txt.gz"
    with gzip.open(p, "wt") as f:
        f.write(ESSAY * 3)
    return p


@pytest.fixture(scope="module")
def samples8k(chat_tok, essay_file):
    samples, skipped = make_samples(chat_tok, 8192, 3, seed=5, subtasks="synthetic", haystack_file=essay_file)
    return samples, skipped


def _family(subtask):
    return "niah" if subtask.startswith("niah") else subtask.split("_")[0]


# ---------------------------------------------------------------- subtask names


def test_resolve_subtasks_names_groups_and_errors():
    assert len(SUBTASKS) == 13 and SUBTASKS[0] == "niah_single_1" and SUBTASKS[-1] == "qa_2"
    assert resolve_subtasks(None) == list(SUBTASKS) == resolve_subtasks("all")
    assert list(DEFAULT_SUBTASKS) == list(SUBTASKS)
    assert resolve_subtasks("niah") == [s for s in SUBTASKS if s.startswith("niah_")] and len(resolve_subtasks("niah")) == 8
    assert resolve_subtasks("vt, niah_single_1,vt") == ["niah_single_1", "vt"]  # RULER's order, once each
    assert resolve_subtasks(["fwe", "common_words_extraction"]) == ["cwe", "fwe"]
    assert resolve_subtasks("qa") == ["qa_1", "qa_2"]
    with pytest.raises(SparseKVError, match="unknown RULER subtask 'niah_single_9'.*niah_single_1.*qa_2"):
        resolve_subtasks("niah_single_9")
    with pytest.raises(SparseKVError, match="no RULER subtask"):
        resolve_subtasks(" , ")


# ---------------------------------------------------------------- every synthetic subtask at 8K


def test_every_sample_fits_and_fills_seq_len(samples8k):
    samples, skipped = samples8k
    assert skipped == {}
    counts = collections.Counter(s.subtask for s in samples)
    assert list(counts) == SYNTHETIC and set(counts.values()) == {3}
    for s in samples:
        assert s.max_new_tokens == GEN[_family(s.subtask)]
        total = len(s.ids) + s.max_new_tokens
        # the haystack grows by whole units (a noise line is 92 bytes): within 2% of seq_len
        assert 8192 * 0.98 <= total <= 8192, (s.subtask, total)
        assert s.metric == "string_match_all"
        assert isinstance(s.answer, list) and s.answer
        assert "model chat template" in s.template


def test_niah_prompts_hold_every_answer_in_a_needle_for_the_asked_key(samples8k, chat_tok):
    for s in samples8k[0]:
        if not s.subtask.startswith("niah"):
            continue
        text = chat_tok.decode(s.ids)
        assert text.endswith(" mentioned in the provided text " + ("is" if len(s.answer) == 1 else "are"))
        query = re.search(r"The special magic \w+ for (.+) mentioned in the provided text (is|are)$", text).group(1)
        keys = re.split(r", and |, ", query)
        kind = "uuids" if s.subtask in ("niah_single_3", "niah_multikey_3") else "numbers"
        for a in s.answer:
            assert any(f"One of the special magic {kind} for {k} is: {a}." in text for k in keys), (s.subtask, a)
        if s.subtask == "niah_single_1":
            assert "A special magic number is hidden within the following text" in text
        if s.subtask == "niah_multivalue":
            assert len(s.answer) == 4 and len(keys) == 1
            assert "Some special magic numbers are hidden" in text and "What are all the special magic numbers" in text
        if s.subtask == "niah_multiquery":
            assert len(s.answer) == 4 and len(keys) == 4
        if s.subtask in ("niah_multikey_2", "niah_multikey_3"):  # distractor needles, none for the asked key
            assert text.count("One of the special magic") > 20
            assert text.count(f" for {keys[0]} is: ") == 1


def test_niah_depth_is_where_the_needle_sits(samples8k, chat_tok):
    for s in samples8k[0]:
        if not s.subtask.startswith("niah"):
            continue
        assert 0.0 <= s.depth <= 1.0
        text = chat_tok.decode(s.ids)
        context = text.split("afterwards.\n", 1)[1].rsplit("\nWhat ", 1)[0]
        needle = re.search(r"One of the special magic \w+ for [\w-]+ is: " + re.escape(s.answer[0]) + r"\.", context)
        before, after = context[:needle.start()], context[needle.end():]
        if s.subtask in ("niah_single_1",):  # noise: count whole noise lines
            at = before.count(NOISE) / (before.count(NOISE) + after.count(NOISE))
        else:  # essay / needle haystacks: by characters
            at = len(before) / (len(before) + len(after))
        assert abs(at - s.depth) < 0.08, (s.subtask, at, s.depth)


def test_essay_tasks_use_the_haystack_file_and_say_so(samples8k, chat_tok):
    for s in samples8k[0]:
        if s.subtask in ("niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multivalue", "niah_multiquery"):
            assert s.template.endswith("haystack: essay (essay.txt.gz)")
            assert "Hackers solve problems" in chat_tok.decode(s.ids)
        elif s.subtask == "niah_single_1":
            assert s.template.endswith("haystack: noise")


def test_essay_fallback_to_noise_is_stated(tok):
    samples, _ = make_samples(tok, 1024, 1, subtasks="niah_single_2")
    assert "haystack: noise (no --haystack-file" in samples[0].template
    assert NOISE in tok.decode(samples[0].ids)
    assert "plain text (model has no chat template)" in samples[0].template


def test_vt_prompt_holds_the_chain(samples8k, chat_tok):
    for s in samples8k[0]:
        if s.subtask != "vt":
            continue
        text = chat_tok.decode(s.ids)
        assert len(s.answer) == 5 and all(re.fullmatch("[A-Z]{5}", v) for v in s.answer)
        value = re.search(r"(\d{5}), they are: $", text).group(1)
        assert f"VAR {s.answer[0]} = {value}" in text
        for a, b in zip(s.answer, s.answer[1:]):
            assert f"VAR {b} = VAR {a} " in text
        # the solved example first: 3-letter variables, its answer after the answer prefix
        example = text.split("Memorize and track", 2)[1]
        assert re.search(r"they are:  [A-Z]{3} [A-Z]{3} [A-Z]{3} [A-Z]{3} [A-Z]{3}\n", example)


def _last_list(text, start, end):
    body = text.rsplit(start, 1)[1].split(end, 1)[0]
    return body


def test_cwe_references_are_the_most_common_words(samples8k, chat_tok):
    for s in samples8k[0]:
        if s.subtask != "cwe":
            continue
        text = chat_tok.decode(s.ids)
        assert text.count("Below is a numbered list of words.") == 2  # the solved example, then the question
        body = _last_list(text, "Memorize the ones that appear most often.\n", "\nQuestion:")
        entries = re.findall(r"(\d+)\. ([a-z]+)", body)
        assert [int(i) for i, _ in entries] == list(range(1, len(entries) + 1))
        freq = collections.Counter(w for _, w in entries)
        assert len(s.answer) == 10 and {freq[w] for w in s.answer} == {30}  # freq_cw at seq >= 4096
        assert {c for w, c in freq.items() if w not in s.answer} == {3}  # freq_ucw
        assert text.endswith(" Answer: The top 10 words that appear most often in the list are:")


def test_fwe_references_are_the_three_most_frequent_coded_words(samples8k, chat_tok):
    for s in samples8k[0]:
        if s.subtask != "fwe":
            continue
        text = chat_tok.decode(s.ids)
        body = _last_list(text, "Find the three most frequently appeared coded words. ", "\nQuestion:")
        freq = collections.Counter(body.split(" "))
        ranked = [w for w, _ in freq.most_common()]
        assert ranked[0] == "..."  # the top-ranked word is replaced by noise dots
        assert ranked[1:4] == s.answer and all(re.fullmatch("[a-z]{6}", w) for w in s.answer)
        assert freq[s.answer[2]] > freq[ranked[4]]


def test_cwe_short_context_uses_rulers_lighter_repeats(tok):
    (s,), _ = make_samples(tok, 3000, 1, subtasks="cwe")
    body = _last_list(tok.decode(s.ids), "Memorize the ones that appear most often.\n", "\nQuestion:")
    freq = collections.Counter(re.findall(r"\d+\. ([a-z]+)", body))
    assert {freq[w] for w in s.answer} == {6} and max(c for w, c in freq.items() if w not in s.answer) == 1


def test_cwe_widens_its_word_pool_when_it_runs_out(tok, monkeypatch):
    from sparsekv.eval.ruler import cwe, words

    monkeypatch.setattr(cwe, "common_words", lambda: words.common_words()[:60])
    (s,), _ = make_samples(tok, 8192, 1, subtasks="cwe")
    assert "adjective-noun compounds" in s.template
    body = _last_list(tok.decode(s.ids), "Memorize the ones that appear most often.\n", "\nQuestion:")
    listed = set(re.findall(r"\d+\. ([a-z]+)", body))
    assert listed - set(words.common_words()[:60]) and set(s.answer) <= listed  # drawn from the wider pool
    assert len(s.ids) + 120 > 8192 * 0.98


# ---------------------------------------------------------------- seeds, depths, lengths


def test_same_seed_same_samples_other_seed_differs(tok):
    a, _ = make_samples(tok, 2048, 2, seed=3, subtasks="niah_single_1,vt,fwe")
    b, _ = make_samples(tok, 2048, 2, seed=3, subtasks="niah_single_1,vt,fwe")
    c, _ = make_samples(tok, 2048, 2, seed=4, subtasks="niah_single_1,vt,fwe")
    assert [(s.ids, s.answer, s.depth) for s in a] == [(s.ids, s.answer, s.depth) for s in b]
    assert all(x.answer != y.answer for x, y in zip(a, c))


def test_a_sample_does_not_depend_on_n_or_on_the_other_subtasks(tok):
    alone, _ = make_samples(tok, 2048, 2, seed=9, subtasks="vt")
    more, _ = make_samples(tok, 2048, 3, seed=9, subtasks="niah_multikey_2,vt,cwe")
    vt = [s for s in more if s.subtask == "vt"]
    assert [s.ids for s in alone] == [s.ids for s in vt[:2]]


def test_depths_spread_over_the_context(tok):
    samples, _ = make_samples(tok, 1024, 20, subtasks="niah_single_1")
    depths = [s.depth for s in samples]
    assert len(set(depths)) >= 10 and max(depths) - min(depths) >= 0.6
    assert all(round(d * 100) in {round(100 * i / 39) for i in range(40)} for d in depths)  # RULER's depth grid


def test_too_short_seq_is_one_clear_error(tok):
    with pytest.raises(SparseKVError, match="seq 300 is too short for RULER subtask niah_single_1: .*needs seq >="):
        make_samples(tok, 300, 1, subtasks="niah_single_1")
    with pytest.raises(SparseKVError, match="seq 100 is too short for RULER subtask niah_single_1: it generates 128"):
        make_samples(tok, 100, 1, subtasks="niah_single_1")
    with pytest.raises(SparseKVError, match="too short for RULER subtask cwe"):
        make_samples(tok, 4096, 1, subtasks="cwe")  # byte tokens: the 10 x 30 common entries alone overflow
    # several subtasks too short: one error names each one's need and the length that fits them all
    with pytest.raises(SparseKVError) as e:
        make_samples(tok, 600, 1, subtasks="niah_single_1,niah_multikey_1,niah_multivalue")
    msg = str(e.value)
    needs = [int(x) for x in re.findall(r"\(needs seq >= (\d+)\)", msg)]
    assert "\n" not in msg and msg.startswith("seq 600 is too short for RULER subtasks niah_multikey_1 (needs"), msg
    assert len(needs) >= 2 and min(needs) > 600 and f"use --seq {max(needs)} or more" in msg, msg


def test_prefix_space_tokenizer_still_fits(tmp_path):
    """A SentencePiece-like tokenizer (a word piece alone gains a prefix token) breaks the additive piece counts;
    the exact check still keeps every prompt within seq_len and close to it."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    chars = sorted(set(ESSAY + NOISE + "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.,:;?!'\"()-\n"))
    vocab = {c: i for i, c in enumerate(["<unk>", "\u2581", *[c for c in chars if c != " "]])}
    t = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    # Llama-2 style: the normalizer prepends "▁" to every text and turns spaces into "▁"
    t.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    t.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    sp = PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>")
    assert len(sp(" word", add_special_tokens=False).input_ids) == 6  # "▁▁word": one more than in context
    essay = tmp_path / "e.txt"
    essay.write_text(ESSAY)
    samples, _ = make_samples(sp, 3000, 3, subtasks="niah_single_2,vt", haystack_file=essay)
    for s in samples:
        assert 3000 * 0.97 <= len(s.ids) + s.max_new_tokens <= 3000


def test_gpt2_tokenizer_if_available_offline():
    transformers = pytest.importorskip("transformers")
    try:
        gpt2 = transformers.AutoTokenizer.from_pretrained("gpt2", local_files_only=True)
    except Exception:  # noqa: BLE001 - not cached here
        pytest.skip("no gpt2 tokenizer cached offline")
    samples, _ = make_samples(gpt2, 4096, 2, subtasks="synthetic")
    for s in samples:
        assert 4096 * 0.98 <= len(s.ids) + s.max_new_tokens <= 4096


# ---------------------------------------------------------------- haystack helpers and search


def test_essay_reading_and_sentences(essay_file, tmp_path):
    e = load_essay(essay_file)
    assert e.name == "essay.txt.gz" and e.words[:3] == ("Hackers", "solve", "problems")
    assert split_sentences("One. Two! Three? \"Four.\" five. Six") == ["One.", "Two!", "Three?", "\"Four.\" five.", "Six"]
    with pytest.raises(SparseKVError, match="haystack file not found"):
        load_essay(tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(SparseKVError, match="holds no text"):
        load_essay(tmp_path / "empty.txt")


def test_essay_context_matches_rulers_sentence_insertion(essay_file):
    """Word-level sentence cuts give exactly what joining, sentence-splitting and inserting (niah.py) gives."""
    e = load_essay(essay_file)
    rng = random.Random(0)
    for _ in range(300):
        n, k = rng.randint(1, 400), rng.randint(1, 4)
        depths, needles = [rng.randint(0, 100) for _ in range(k)], [f"N{j}." for j in range(k)]
        sents = split_sentences(" ".join((list(e.words) * 10)[:n]))
        pairs = sorted(zip(depths, needles))
        pos = [0] + [int(len(sents) * d / 100) for d, _ in pairs] + [len(sents)]
        parts = []
        for i in range(1, len(pos)):
            parts.append(" ".join(sents[pos[i - 1]:pos[i]]))
            if i - 1 < len(pairs):
                parts.append(pairs[i - 1][1])
        assert "".join(e.context(n, depths, needles)) == " ".join(parts)


def test_largest_fitting_matches_brute_force():
    rng = random.Random(1)
    for _ in range(200):
        per, hi = rng.uniform(0.5, 40), 3000
        steps = [rng.randint(0, 3) for _ in range(hi + 2)]
        mono = [int(50 + per * s) + c for s, c in enumerate(itertools.accumulate(steps))] if _ < 20 else None
        count = (lambda s, m=mono: m[s]) if mono else (lambda s, per=per, st=steps: int(50 + per * s) + st[s])
        budget = rng.randint(60, 20000)
        got, _ = largest_fitting(count, budget, rng.randint(1, hi), 1, hi, rng.uniform(0.5, 40))
        if count(1) > budget:
            assert got is None
            continue
        assert count(got) <= budget and (got == hi or count(got + 1) > budget)  # fits; one more does not
        if mono:
            assert got == max(s for s in range(1, hi + 1) if mono[s] <= budget)


# ---------------------------------------------------------------- qa: datasets or a stated skip


def test_qa_is_skipped_with_the_reason_when_datasets_is_not_installed(tok, unimportable):
    unimportable("datasets")
    ruler_qa.clear_cache()
    try:
        samples, skipped = make_samples(tok, 1024, 1, subtasks="qa_1,niah_single_1")
        assert [s.subtask for s in samples] == ["niah_single_1"]
        assert "needs the `datasets` package: pip install 'sparsekv[data]'" in skipped["qa_1"]
    finally:
        ruler_qa.clear_cache()


def test_qa_is_skipped_with_the_reason_when_datasets_cannot_load(tok, monkeypatch):
    datasets = pytest.importorskip("datasets", reason="the test extra (sparsekv[test]) brings datasets")

    def no_hub(*a, **k):
        raise ConnectionError("Couldn't reach 'rajpurkar/squad_v2' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", no_hub)
    monkeypatch.setattr(ruler_qa, "_hub_reachable", lambda timeout=3.0: None)
    ruler_qa.clear_cache()
    try:
        samples, skipped = make_samples(tok, 1024, 2, subtasks="qa,niah_single_1")
        assert [s.subtask for s in samples] == ["niah_single_1"] * 2
        assert list(skipped) == ["qa_1", "qa_2"]
        assert "rajpurkar/squad_v2" in skipped["qa_1"] and "ConnectionError" in skipped["qa_1"]
        assert "hotpotqa/hotpot_qa" in skipped["qa_2"]
        assert skipped_subtasks("all") == skipped and skipped_subtasks("niah") == {}
    finally:
        ruler_qa.clear_cache()


def test_qa_skips_at_once_when_the_hub_is_unreachable(tok, monkeypatch):
    datasets = pytest.importorskip("datasets", reason="the test extra (sparsekv[test]) brings datasets")

    def must_not_load(*a, **k):
        raise AssertionError("load_dataset called although the Hub is unreachable and nothing is cached")

    monkeypatch.setattr(datasets, "load_dataset", must_not_load)
    monkeypatch.setattr(ruler_qa, "_hub_reachable", lambda timeout=3.0: "huggingface.co unreachable (no route)")
    monkeypatch.setattr(ruler_qa, "_cached_locally", lambda hub_id: False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    ruler_qa.clear_cache()
    try:
        assert "not reachable: huggingface.co unreachable" in skipped_subtasks("qa_1")["qa_1"]
    finally:
        ruler_qa.clear_cache()


SQUAD = [  # rows as `datasets` gives rajpurkar/squad_v2: one per question, unanswerable ones have no answer text
    {"title": "Rivers", "context": "The Nile is the longest river in Africa. It flows north.",
     "question": "Which river is the longest in Africa?", "answers": {"text": ["The Nile", "Nile"]}},
    {"title": "Rivers", "context": "The Amazon carries the most water of any river.",
     "question": "What is the capital of the Amazon?", "answers": {"text": []}},
    {"title": "Rivers", "context": "The Amazon carries the most water of any river.",
     "question": "Which river carries the most water?", "answers": {"text": ["The Amazon"]}},
] + [{"title": f"T{i}", "context": f"Paragraph {i} talks about topic number {i} at some length, on purpose.",
      "question": f"What does paragraph {i} talk about?", "answers": {"text": [f"topic number {i}"]}}
     for i in range(60)]

HOTPOT = [{"question": f"Which came first, thing {i} or thing {i + 1}?", "answer": f"thing {i}",
           "context": {"title": [f"Title {i}-{j}" for j in range(10)],
                       "sentences": [[f"Thing {i}.{j} came ", f"in year {1900 + j}."] for j in range(10)]}}
          for i in range(40)]


def test_qa_prompts_from_datasets_rows(tok, monkeypatch):
    datasets = pytest.importorskip("datasets", reason="the test extra (sparsekv[test]) brings datasets")

    def fake(hub_id, config=None, split=None):
        return SQUAD if hub_id == "rajpurkar/squad_v2" else HOTPOT

    monkeypatch.setattr(datasets, "load_dataset", fake)
    monkeypatch.setattr(ruler_qa, "_hub_reachable", lambda timeout=3.0: None)
    ruler_qa.clear_cache()
    try:
        samples, skipped = make_samples(tok, 2048, 2, subtasks="qa")
        assert skipped == {} and [s.subtask for s in samples] == ["qa_1", "qa_1", "qa_2", "qa_2"]
        q1, q2 = samples[0], samples[1]
        assert q1.answer == ["The Nile", "Nile"] and q2.answer == ["The Amazon"]  # answerable questions, in order
        for s in samples:
            text = tok.decode(s.ids)
            assert s.metric == "string_match_part" and s.max_new_tokens == 32
            assert 2048 * 0.95 <= len(s.ids) + 32 <= 2048
            assert text.startswith("Answer the question based on the given documents.")
            assert "Document 1:\n" in text and text.endswith("? Answer:")
            assert "via datasets" in s.template
        assert "The Nile is the longest river in Africa." in tok.decode(q1.ids)
        assert "The Amazon carries the most water" in tok.decode(q1.ids)  # same-article paragraph goes in first
        hot = tok.decode(samples[2].ids)
        assert all(f"Title 0-{j}\nThing 0.{j} came in year {1900 + j}." in hot for j in range(10))
    finally:
        ruler_qa.clear_cache()


# ---------------------------------------------------------------- scorers, against RULER's own


def _ruler_postprocess(pred):  # scripts/eval/evaluate.py postprocess_pred
    return re.compile(r"[\x00-\x1f]").sub("\n", pred.strip()).strip()


def _ruler_all(preds, refs):  # scripts/eval/synthetic/constants.py
    return round(sum(sum(1.0 if r.lower() in p.lower() else 0.0 for r in ref) / len(ref)
                     for p, ref in zip(preds, refs)) / len(preds) * 100, 2)


def _ruler_part(preds, refs):
    return round(sum(max(1.0 if r.lower() in p.lower() else 0.0 for r in ref)
                     for p, ref in zip(preds, refs)) / len(preds) * 100, 2)


CASES = [
    (" 1234567.", ["1234567"]),
    ("The special magic numbers are 1234567 and 7654321.\x00", ["1234567", "7654321", "1111111"]),
    ("  UUID: 3F2504E0-4F89-41D3-9A0C-0305E82C3301 ", ["3f2504e0-4f89-41d3-9a0c-0305e82c3301"]),
    ("ABCDE, FGHIJ,\tKLMNO\n", ["ABCDE", "FGHIJ", "KLMNO", "PQRST", "UVWXY"]),
    ("1. apple 2. Pear 3. plum", ["apple", "pear", "plum", "fig"]),
    ("", ["anything"]),
    ("Denver Broncos", ["Denver Broncos", "The Broncos"]),
    ("the broncos won", ["Denver Broncos", "Broncos"]),
]


def test_scorers_match_rulers_string_match_all_and_part():
    assert metrics.string_match_all("The special magic numbers are 123 and 456", ["123", "456", "789"]) == 2 / 3
    assert metrics.string_match_part("broncos", ["Denver Broncos", "Broncos"]) == 1.0
    preds = [_ruler_postprocess(p) for p, _ in CASES]
    refs = [r for _, r in CASES]
    ours_all = round(sum(metrics.score("string_match_all", p, r) for p, r in CASES) / len(CASES) * 100, 2)
    ours_part = round(sum(metrics.score("string_match_part", p, r) for p, r in CASES) / len(CASES) * 100, 2)
    assert ours_all == _ruler_all(preds, refs)
    assert ours_part == _ruler_part(preds, refs)
    for p, _ in CASES:
        assert metrics.postprocess(p) == _ruler_postprocess(p)


def test_smollm2_tokenizer_if_cached():
    """The default model's tokenizer and chat template (only when an earlier run converted it; no download)."""
    from sparsekv.models import cache_home

    where = cache_home() / "models" / "smollm2-135m-instruct-q4_1"
    if not (where / "tokenizer_config.json").is_file():
        pytest.skip("SmolLM2 tokenizer not cached")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(where))
    samples, _ = make_samples(tok, 4096, 2, subtasks="niah_single_1,niah_multikey_3,cwe")
    for s in samples:
        assert 4096 * 0.98 <= len(s.ids) + s.max_new_tokens <= 4096
        text = tok.decode(s.ids)
        assert text.startswith("<|im_start|>") and "<|im_start|>assistant\n " in text
        assert all(a in text for a in s.answer)
