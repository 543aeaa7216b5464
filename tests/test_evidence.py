"""Evidence: the prompt tokens that spell the answer, recorded by a prompt dump and scored by recall."""

import pytest
import torch

from sparsekv.activations import load_activations, dump_prompts
from sparsekv.eval import passkey
from sparsekv.eval.evidence import evidence_positions
from sparsekv.eval.recall import EVIDENCE, recall_grid
from sparsekv.eval.runner import RunSpec

pytestmark = pytest.mark.usefixtures("one_thread")
BUDGET = 24


class Pieces:
    """A tokenizer whose token i decodes to pieces[i] (merged tokens, as a BPE vocabulary has them)."""

    def __init__(self, pieces):
        self.pieces = pieces

    def batch_decode(self, ids):
        return [self.pieces[i[0]] for i in ids]


def test_merged_tokens_at_the_edges_count():
    tok = Pieces(["The", " key", " is", " 5", "123", "4.", " Again", ":", " 51234", " and", " 51234", "9"])
    # " 5" and "4." hold the first and last characters; " 51234" is whole; "512349" is another number
    assert evidence_positions(tok, range(12), ["51234"]) == [3, 4, 5, 8]
    assert evidence_positions(tok, range(12), [" 51234 ", ""]) == [3, 4, 5, 8]  # references are stripped
    assert evidence_positions(tok, range(12), ["1234", "key"]) == [1]  # not inside a longer word or number
    assert evidence_positions(tok, range(3), ["51234"]) == []


def test_byte_tokens(tiny):
    ids = tiny.tokenizer("The pass key is 51234. Remember it. 1234", add_special_tokens=False).input_ids
    assert evidence_positions(tiny.tokenizer, ids, ["51234"]) == list(range(16, 21))
    assert evidence_positions(tiny.tokenizer, ids, ["1234"]) == list(range(36, 40))


@pytest.fixture(scope="module")
def prompts(tiny, tmp_path_factory):
    samples = passkey.make_samples(tiny.tokenizer, 300, 3, seed=5)
    out = tmp_path_factory.mktemp("evidence") / "p"
    return samples, load_activations(dump_prompts(tiny, samples, out, queries_per_seq=3, source="passkey"))


def test_the_prompt_dump_records_where_the_pass_key_is(tiny, prompts):
    samples, acts = prompts
    ev = acts.evidence()
    assert len(ev) == len(samples) and acts.data["evidence_prompts"] == len(samples)
    assert acts.data["evidence_tokens"] == sum(len(e) for e in ev)
    for s, e in zip(samples, ev):
        # the needle states the key twice ("The pass key is K. Remember it. K is the pass key."): byte tokens
        assert len(e) == 2 * len(s.answer) and int(e.max()) < len(s.ids)  # in the prompt, not its answer
        assert tiny.tokenizer.decode([s.ids[i] for i in e.tolist()]) == 2 * s.answer


def probs_of(acts, layer, j):
    """Exact attention of dumped query j at `layer`: [Hq, p + 1], and its position and sequence."""
    d = acts.layer(layer)
    s, p = int(d["q_seq"][j]), int(d["q_pos"][j])
    off, G = acts.seq_offsets[s], acts.q_heads // acts.kv_heads
    k = d["k_post"][:, off : off + p + 1].double().repeat_interleave(G, 0)  # [Hq, p + 1, D]
    logits = torch.einsum("hd,hnd->hn", d["q_post"][:, j].double(), k) / acts.head_dim**0.5
    return torch.softmax(logits, -1), p, s


def test_evidence_recall_is_the_hand_computation(prompts):
    samples, acts = prompts
    # the oracle StreamingLLM is compared with: its 4 sink tokens, and exact top-k for the rest
    stream, oracle, whole = recall_grid(acts, [RunSpec("streaming", BUDGET), RunSpec("oracle", BUDGET, {"sink": 4}),
                                               RunSpec("oracle", max(acts.seq_lengths))])
    assert oracle["method_config"] == stream["iou_reference"]
    ev = acts.evidence()
    read = total = share = 0.0
    pairs = 0
    for layer in range(acts.num_layers):
        lr = lt = 0.0
        for j in range(acts.queries):
            pr, p, s = probs_of(acts, layer, j)
            keep = torch.zeros(p + 1, dtype=torch.bool)
            keep[:4] = True  # StreamingLLM: 4 sink tokens, the window takes the rest of the budget
            keep[p + 1 - (BUDGET - 4):] = True
            on = pr[:, ev[s]]
            lt += float(on.sum())
            lr += float((on * keep[ev[s]]).sum())
            share += float(on.sum())
            pairs += pr.shape[0]
        row = stream["per_layer"][layer]
        assert row["evidence_recall"] == pytest.approx(lr / lt, abs=1e-5)
        read, total = read + lr, total + lt
    assert stream["evidence_recall"] == pytest.approx(read / total, abs=1e-6)
    assert stream["evidence_share"] == pytest.approx(share / pairs, abs=1e-6)
    assert stream["evidence_recall"] < 0.5  # the pass key sits in the middle, outside sink and window
    assert stream["oracle_evidence_recall"] == pytest.approx(oracle["evidence_recall"])
    assert oracle["oracle_evidence_recall"] == pytest.approx(oracle["evidence_recall"])
    assert whole["evidence_recall"] == pytest.approx(1.0)
    assert "evidence_recall" in stream["protocol"]


def test_a_text_dump_has_no_evidence(tiny, tmp_path):
    from sparsekv.activations import dump_activations

    tokens = torch.randint(0, 256, (120,), generator=torch.Generator().manual_seed(2)).tolist()
    acts = load_activations(dump_activations(tiny, tokens, tmp_path / "d", seq_len=120, queries_per_seq=8, seed=1))
    assert acts.evidence() is None
    r = recall_grid(acts, [RunSpec("oracle", 16)])[0]
    assert all(r[k] is None for k in EVIDENCE) and all(row[k] is None for row in r["per_layer"] for k in EVIDENCE)
