"""`dump`: recorded q/k must be exactly what the model computes, at the right positions, pre- and post-RoPE."""

import io
import json
import sys

import pytest
import torch
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from sparsekv import artifacts
from sparsekv.activations import dump_activations, dump_prompts, load_activations, split_sequences, text_tokens
from sparsekv.artifacts import ArtifactError
from sparsekv.errors import SparseKVError
from sparsekv.models import cache_kwarg, load_model, tiny_random

SEQ, QPS = 128, 32


@pytest.fixture(scope="module")
def lm():
    return load_model("tiny-random")


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(1)).tolist()


@pytest.fixture(scope="module")
def dump(lm, tokens, tmp_path_factory):
    out = tmp_path_factory.mktemp("acts") / "d"
    calls = []
    path = dump_activations(lm, tokens, out, seq_len=SEQ, queries_per_seq=QPS, seed=3, source="random bytes",
                            progress=lambda done, total: calls.append((done, total)))
    assert path == out
    assert calls == [(128, 300), (256, 300), (300, 300)]
    return load_activations(path, lm)


def plain_forward(seq_ids):
    """The same weights through stock HF attention and DynamicCache; q/k projections captured by hooks."""
    model = tiny_random(seed=0).model.eval()  # same seed as load_model("tiny-random"), not wired to sparsekv
    proj = {}
    hooks = [getattr(layer.self_attn, name).register_forward_hook(
        lambda mod, inp, out, key=(i, name): proj.__setitem__(key, out.detach()))
        for i, layer in enumerate(model.model.layers) for name in ("q_proj", "k_proj")]
    ids = torch.tensor([seq_ids])
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(input_ids=ids, **cache_kwarg(model, cache), use_cache=True)
    for h in hooks:
        h.remove()
    pos = torch.arange(len(seq_ids)).unsqueeze(0)
    cos, sin = model.model.rotary_emb(ids.float(), pos)
    return model, cache, proj, cos, sin


def heads(x, h, d):  # [1, n, h*d] -> [1, h, n, d]
    return x.view(1, x.shape[1], h, d).transpose(1, 2)


def close(got, want, what):
    # fp16 storage: relative error ~5e-4 of the value's magnitude
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-3, atol=2e-3 * float(want.abs().max()),
                               msg=lambda m: f"{what}: {m}")


def test_shapes_and_positions(dump, lm):
    assert (dump.num_layers, dump.kv_heads, dump.q_heads, dump.head_dim) == (2, 2, 6, 20)
    assert dump.tokens == 300 and dump.queries == 3 * QPS
    assert dump.seq_lengths == [128, 128, 44] and dump.seq_offsets == [0, 128, 256]
    assert dump.data["source"] == "random bytes" and dump.data["seed"] == 3 and dump.config["dtype"] == "float16"
    for i in range(dump.num_layers):
        d = dump.layer(i)
        assert d["k_pre"].shape == d["k_post"].shape == (2, 300, 20)
        assert d["q_pre"].shape == d["q_post"].shape == (6, 3 * QPS, 20)
        assert all(d[k].dtype == torch.float16 for k in ("k_pre", "k_post", "q_pre", "q_post"))
        assert not torch.equal(d["k_pre"], d["k_post"])  # RoPE did something
    d = dump.layer(0)
    assert torch.equal(d["k_pos"], torch.cat([torch.arange(128), torch.arange(128), torch.arange(44)]))
    assert torch.equal(d["k_seq"], torch.tensor([0] * 128 + [1] * 128 + [2] * 44))
    assert torch.equal(d["q_seq"], torch.tensor([0] * QPS + [1] * QPS + [2] * QPS))
    for s, n in enumerate([128, 128, 44]):
        qp = d["q_pos"][d["q_seq"] == s]
        assert len(qp.unique()) == QPS and bool((qp[1:] > qp[:-1]).all()) and 0 <= int(qp.min()) and int(qp.max()) < n
    with pytest.raises(SparseKVError, match="layer 2 out of range"):
        dump.layer(2)


def test_k_pre_rotated_forward_is_k_post(dump, lm):
    rotary = lm.model.model.rotary_emb
    for i in range(dump.num_layers):
        d = dump.layer(i)
        cos, sin = rotary(d["k_pre"].float(), d["k_pos"].unsqueeze(0))  # [1, T, D]
        k_pre, k_post = d["k_pre"].float().unsqueeze(0), d["k_post"].float().unsqueeze(0)
        _, rotated = apply_rotary_pos_emb(k_pre, k_pre, cos, sin)
        close(rotated[0], k_post[0], f"layer {i} rotate(k_pre)")


def test_keys_and_queries_match_plain_hf_forward(dump, tokens):
    offs = dump.seq_offsets
    for s, n in enumerate(dump.seq_lengths):
        model, pkv, proj, cos, sin = plain_forward(tokens[offs[s] : offs[s] + n])
        for i in range(dump.num_layers):
            d = dump.layer(i)
            rows = d["k_seq"] == s
            close(d["k_post"][:, rows], pkv.layers[i].keys[0], f"seq {s} layer {i} k_post vs DynamicCache")
            close(d["k_pre"][:, rows], heads(proj[i, "k_proj"], 2, 20)[0], f"seq {s} layer {i} k_pre vs k_proj")
            q_pre = heads(proj[i, "q_proj"], 6, 20)
            q_post, _ = apply_rotary_pos_emb(q_pre, q_pre, cos, sin)
            qrows = d["q_seq"] == s
            at = d["q_pos"][qrows]
            close(d["q_post"][:, qrows], q_post[0][:, at], f"seq {s} layer {i} q_post")
            close(d["q_pre"][:, qrows], q_pre[0][:, at], f"seq {s} layer {i} q_pre")


def test_prompts_are_recorded_where_their_answer_is_produced(lm, tmp_path):
    """dump_prompts: each prompt with its reference answer appended, queries at the last prompt token and the
    answer's tokens before its last (the first queries_per_seq of them); the q/k are the plain forward's."""
    from sparsekv.eval import passkey

    samples = passkey.make_samples(lm.tokenizer, 300, 2, seed=5)
    acts = load_activations(dump_prompts(lm, samples, tmp_path / "p", queries_per_seq=3, source="passkey", seed=5))
    answers = [lm.tokenizer(" " + s.answer, add_special_tokens=False).input_ids for s in samples]
    assert all(len(a) > 3 for a in answers)  # byte tokens: the answer is longer than the queries kept
    assert acts.seq_lengths == [len(s.ids) + len(a) for s, a in zip(samples, answers)]
    pos = acts.positions()
    for j, s in enumerate(samples):
        assert pos["q_pos"][pos["q_seq"] == j].tolist() == [len(s.ids) - 1, len(s.ids), len(s.ids) + 1]
    assert acts.data["prompts"] == 2 and acts.data["source"] == "passkey" and acts.data["seed"] == 5
    assert acts.config["query_sampling"].startswith("answer positions")
    ids = list(samples[1].ids) + answers[1]
    _, pkv, proj, cos, sin = plain_forward(ids)
    d = acts.layer(1)
    close(d["k_post"][:, d["k_seq"] == 1], pkv.layers[1].keys[0], "k_post")
    q_pre = heads(proj[1, "q_proj"], 6, 20)
    q_post, _ = apply_rotary_pos_emb(q_pre, q_pre, cos, sin)
    rows = d["q_seq"] == 1
    close(d["q_post"][:, rows], q_post[0][:, d["q_pos"][rows]], "q_post")
    with pytest.raises(SparseKVError, match="no prompts to dump"):
        dump_prompts(lm, [], tmp_path / "none")


def test_seeded_and_reproducible(lm, tokens, tmp_path, dump):
    a = load_activations(dump_activations(lm, tokens, tmp_path / "a", seq_len=SEQ, queries_per_seq=QPS, seed=3))
    b = load_activations(dump_activations(lm, tokens, tmp_path / "b", seq_len=SEQ, queries_per_seq=QPS, seed=4))
    assert torch.equal(a.layer(1)["q_pos"], dump.layer(1)["q_pos"])
    assert torch.equal(a.layer(1)["q_post"], dump.layer(1)["q_post"])
    assert not torch.equal(b.layer(1)["q_pos"], a.layer(1)["q_pos"])


def test_short_tail_dropped_and_more_queries_than_tokens(lm, tokens, tmp_path):
    assert split_sequences(268, 128) == [(0, 128), (128, 128)]
    assert split_sequences(272, 128) == [(0, 128), (128, 128), (256, 16)]
    acts = load_activations(dump_activations(lm, tokens[:268], tmp_path / "d", seq_len=SEQ, queries_per_seq=200))
    assert acts.tokens == 256 and acts.data["tokens_given"] == 268
    assert acts.queries == 256  # every position of each sequence, no repeats
    assert torch.equal(acts.layer(0)["q_pos"], acts.layer(0)["k_pos"])


def test_rich_progress_and_float32(lm, tokens, tmp_path):
    from rich.console import Console
    from rich.progress import Progress

    with Progress(console=Console(file=io.StringIO())) as progress:
        path = dump_activations(lm, tokens, tmp_path / "d", seq_len=SEQ, queries_per_seq=4, dtype=torch.float32,
                                progress=progress)
        (task,) = progress.tasks
        assert task.completed == task.total == 300
    d = load_activations(path).layer(0)
    assert d["k_post"].dtype == torch.float32


def test_fingerprint_mismatch_is_one_clear_line(dump):
    with pytest.raises(ArtifactError) as e:
        load_activations(dump.path, tiny_random(seed=1))
    msg = str(e.value)
    assert "\n" not in msg and "another model" in msg and "weights_sha256" in msg and "seed=1" in msg


def test_a_dump_of_the_same_model_in_another_dtype_says_so(dump):
    """Only the weights hash differs (an fp16 load rounds twice): the message names the dump's dtype."""
    with pytest.raises(ArtifactError) as e:
        load_activations(dump.path, tiny_random(dtype=torch.float16))
    msg = str(e.value)
    assert "\n" not in msg and "dumped from other weights" in msg and "weights_sha256" in msg, msg
    assert "the dump's model ran in float32 (--dtype fp32)" in msg, msg


def test_corrupted_layer_is_caught(lm, tokens, tmp_path):
    path = dump_activations(lm, tokens[:100], tmp_path / "d", seq_len=SEQ, queries_per_seq=4)
    f = path / "layer_001.safetensors"
    raw = bytearray(f.read_bytes())
    raw[-10] ^= 0xFF
    f.write_bytes(bytes(raw))
    acts = load_activations(path, lm)  # opening is cheap: hashes are checked per file on first load
    acts.layer(0)
    with pytest.raises(ArtifactError, match="layer_001.safetensors sha256 mismatch"):
        acts.layer(1)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["method"] = "adamas"
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="edited manifest"):
        load_activations(path)
    manifest[artifacts.DIGEST] = artifacts.manifest_digest(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="not an activations dump"):  # a consistent one of another kind too
        load_activations(path)


def test_bad_dump_inputs(lm, tokens, tmp_path):
    (tmp_path / "exists").mkdir()
    with pytest.raises(SparseKVError, match="already exists"):
        dump_activations(lm, tokens, tmp_path / "exists", seq_len=SEQ)
    with pytest.raises(SparseKVError, match="at least 16 tokens"):
        dump_activations(lm, tokens[:10], tmp_path / "short", seq_len=SEQ)
    with pytest.raises(SparseKVError, match="--seq must be at least 16 tokens, got 1"):
        dump_activations(lm, tokens, tmp_path / "one", seq_len=1)
    with pytest.raises(SparseKVError, match="exceeds the model's context"):
        dump_activations(lm, tokens, tmp_path / "long", seq_len=lm.max_context + 1)
    unwired = tiny_random(seed=0)  # not loaded through load_model: the recorder never runs
    with pytest.raises(SparseKVError, match="does not run the sparsekv attention"):
        dump_activations(unwired, tokens, tmp_path / "unwired", seq_len=SEQ)
    assert not any(p.name != "exists" for p in tmp_path.iterdir())  # failures leave nothing behind


def test_fp16_overflow_is_reported(tokens, tmp_path):
    big = load_model("tiny-random")
    big.model.model.layers[1].self_attn.k_proj.weight.data.mul_(1e5)
    with pytest.raises(SparseKVError, match="layer 1: k_post overflows float16"):
        dump_activations(big, tokens, tmp_path / "d", seq_len=SEQ)
    assert not (tmp_path / "d").exists()


def test_text_tokens_from_file(lm, tmp_path):
    f = tmp_path / "t.txt"
    text = "The quick brown fox jumps over the lazy dog. " * 10
    f.write_text(text)
    ids = text_tokens(lm, f, tokens=100)
    assert ids == lm.tokenizer.encode(text, add_special_tokens=False)[:100]
    with pytest.raises(SparseKVError, match=r"t.txt has only 450 tokens; 1000 asked"):
        text_tokens(lm, f, tokens=1000)
    with pytest.raises(SparseKVError, match="text file not found: .*missing.txt"):
        text_tokens(lm, tmp_path / "missing.txt", tokens=10)
    with pytest.raises(SparseKVError, match="exactly one"):
        text_tokens(lm, tokens=10)


def test_text_tokens_large_file_reads_a_prefix(lm, tmp_path):
    f = tmp_path / "big.txt"
    text = "".join(f"line {i}: some text é\n" for i in range(40000))  # ~940K byte tokens
    f.write_text(text)
    ids = text_tokens(lm, f, tokens=70000)  # reads a 560K-character prefix, not the whole file
    assert ids == lm.tokenizer.encode(text, add_special_tokens=False)[:70000]


def test_text_tokens_dataset_errors(lm, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import fails as if not installed
    with pytest.raises(SparseKVError, match="needs the `datasets` package"):
        text_tokens(lm, dataset="pg19", tokens=10)

    class FakeDatasets:
        calls = []

        @staticmethod
        def load_dataset(name, config, split, streaming):
            FakeDatasets.calls.append((name, config, split, streaming))
            if name == "nobody/nothing":
                raise ConnectionError("Couldn't reach the Hub\nsecond line")
            return iter([{"id": 1, "text": "abc"}, {"id": 2, "text": "defg"}])

    monkeypatch.setitem(sys.modules, "datasets", FakeDatasets)
    with pytest.raises(SparseKVError, match="cannot read dataset 'nobody/nothing'.*Couldn't reach the Hub second") as e:
        text_tokens(lm, dataset="nobody/nothing", tokens=10)
    assert "\n" not in str(e.value)
    eos = lm.tokenizer.eos_token_id
    assert text_tokens(lm, dataset="pg19", tokens=6) == [*lm.tokenizer.encode("abc"), eos, *lm.tokenizer.encode("de")]
    assert FakeDatasets.calls[-1] == ("emozilla/pg19", None, "test", True)
    with pytest.raises(SparseKVError, match="has only 8 tokens in its test split; 9 asked"):
        text_tokens(lm, dataset="x/y:cfg", tokens=9)
    assert FakeDatasets.calls[-1] == ("x/y", "cfg", "test", True)
