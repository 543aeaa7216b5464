"""train-hash (Spotlight): the ranking loss, the shared training loop (resume to the same weights), the artifact."""

import json
import math
from pathlib import Path

import pytest
import torch

from sparsekv.errors import SparseKVError
from sparsekv.offline import targets
from sparsekv.offline.data import DumpExamples
from sparsekv.offline.train import TrainConfig, train
from sparsekv.patterns import FULL
from sparsekv.train_hash import HashModel, SpotlightObjective, fit_hashes, rank_loss, train_hashes

pytestmark = pytest.mark.usefixtures("one_thread")


class ClusteredDump:
    """A dump stand-in with a known answer: keys drawn around 8 directions (16 per direction, shuffled), each query
    pointing at one direction, so a query's exact top-k are the keys of its direction. The queries also share a
    large offset along a dimension the keys do not use (queries and keys in two cones, as the paper describes): it
    changes no q·k but makes an untrained hash give every query the same code."""

    def __init__(self, seqs=6, n=128, d=16, layers=2, hq=2, seed=0, path="synthetic"):
        g = torch.Generator().manual_seed(seed)
        centers = torch.nn.functional.normalize(torch.randn(layers, 8, d, generator=g), dim=-1)
        centers[..., -1] = 0  # the keys' directions leave the last dimension to the queries' offset
        offset = torch.zeros(d)
        offset[-1] = 30.0
        ks, qs, q_pos, q_seq = [], [], [], []
        for s in range(seqs):
            which = torch.randperm(n, generator=g) % 8
            ks.append(centers[:, which] * 4 + 0.3 * torch.randn(layers, n, d, generator=g))
            pos = torch.arange(n // 2, n, 4)
            target = which[pos]  # each query looks for the direction of a key it sees
            qs.append((centers[:, target] * 6 + offset)[:, None].expand(layers, hq, -1, d)
                      + 0.3 * torch.randn(layers, hq, len(pos), d, generator=g))
            q_pos.append(pos)
            q_seq.append(torch.full((len(pos),), s))
        self.k = torch.cat(ks, 1)[:, None]  # [L, 1, T, D]
        self.q = torch.cat(qs, 2)
        self._pos = {"q_pos": torch.cat(q_pos), "q_seq": torch.cat(q_seq),
                     "k_pos": torch.arange(n).repeat(seqs), "k_seq": torch.arange(seqs).repeat_interleave(n)}
        self.num_layers, self.kv_heads, self.q_heads, self.head_dim = layers, 1, hq, d
        self.seq_lengths, self.seq_offsets = [n] * seqs, [i * n for i in range(seqs)]
        self.path = Path(path)
        self.tokens, self.queries = n * seqs, len(self._pos["q_pos"])
        self.data = {"source": "synthetic", "tokens_sha256": "0" * 64}
        self.manifest = {"model": {"name": "synthetic", "num_layers": layers}, "manifest_sha256": "x"}

    def layer(self, i):
        return {"k_post": self.k[i], "k_pre": self.k[i], "q_post": self.q[i], "q_pre": self.q[i]}

    def positions(self):
        return self._pos

    def patterns(self):
        return [FULL] * self.num_layers


def brute_force_loss(sim, idx, valid, vis, alpha, beta):
    """Eq. 9 per query by loops over the pairs: mean over (i in top-k, j seen and not in it) of -log σ(β Z - α)."""
    L, H, nq, nk = sim.shape
    out = torch.zeros(L, H, nq, dtype=torch.float64)
    for l in range(L):
        for h in range(H):
            for q in range(nq):
                top = {int(i) for i, ok in zip(idx[l, h, q], valid[0, 0, q]) if ok}
                rest = [j for j in range(nk) if vis[l, 0, q, j] and j not in top]
                terms = [-torch.nn.functional.logsigmoid(beta * (sim[l, h, q, i] - sim[l, h, q, j]) - alpha)
                         for i in top for j in rest]
                out[l, h, q] = torch.stack(terms).double().mean() if terms else 0.0
    return out


def test_rank_loss_and_its_gradient_equal_the_pairs_by_hand():
    g = torch.Generator().manual_seed(0)
    L, H, nq, nk = 2, 3, 5, 23
    sim = torch.randn(L, H, nq, nk, generator=g, dtype=torch.float64)
    q_pos = torch.tensor([3, 9, 14, 20, 22])
    vis = targets.visible(q_pos, nk, [0, 6])  # layer 1 has a sliding window of 6 keys
    k = targets.keep_count(vis.sum(-1)[0, 0], 0.25)
    idx, valid = targets.topk_sets(torch.randn(L, H, nq, nk, generator=g), vis, k)
    got_in = sim.clone().requires_grad_()
    got = rank_loss(got_in, idx, valid, vis, 3.0, 1.5)
    ref_in = sim.clone().requires_grad_()
    ref = brute_force_loss(ref_in, idx, valid, vis, 3.0, 1.5)
    torch.testing.assert_close(got.double(), ref)
    w = torch.randn(L, H, nq, generator=g, dtype=torch.float64)
    (got * w).sum().backward()
    (ref * w).sum().backward()
    torch.testing.assert_close(got_in.grad, ref_in.grad)


def test_training_finds_the_known_answer():
    """On the clustered problem the top-k is learnable: the loss falls and the held-out IoU rises far above the
    untrained hash's."""
    acts = ClusteredDump()
    tensors, config, report = train_hashes(acts, iters=80, hidden=32, nbits=32, keep=16 / 128, lr=1e-2,
                                           queries_per_step=16, holdout=0.34, eval_every=40)
    curve = report["train"]["loss_curve"]
    assert curve[-1][1] < 0.5 * curve[0][1]
    iou = report["iou"]["mean"]
    assert iou["mlp_before"] < 0.3 and iou["linear_before"] < 0.3  # the offset gives every query one code
    assert iou["mlp_after"] > 0.5 and iou["mlp_after"] > iou["mlp_before"] + 0.3
    assert report["heldout"]["sequences"] == 2 and not report["heldout"]["from_fit_sequences"]
    assert tensors["w1"].shape == (2, 1, 16, 32) and tensors["w2"].shape == (2, 1, 32, 32)
    assert tensors["layers"].tolist() == [0, 1] and config["pruning_rate"] == pytest.approx(1 - 16 / 128)
    assert [s for s, _ in report["train"]["heldout_curve"]] == [40, 80]
    # ternary queries at 0.35 rank worse here (the queries' large outputs carry the shared offset, not their
    # direction): the binary queries' margin 0 is recorded, and the method takes it
    ious = report["query_margin"]["held_out_iou"]
    assert ious["0.0"] == pytest.approx(iou["mlp_after"], abs=1e-4) and ious["0.35"] < ious["0.0"] - 0.1
    assert config["query_margin"] == report["query_margin"]["chosen"] == 0.0
    _, config, report = train_hashes(acts, iters=80, hidden=32, nbits=32, keep=16 / 128, lr=1e-2,
                                     queries_per_step=16, holdout=0.34, eval_every=40, query_margin=0)
    assert config["query_margin"] == 0.0 and list(report["query_margin"]["held_out_iou"]) == ["0.0"]
    with pytest.raises(SparseKVError, match="query-margin"):
        train_hashes(acts, iters=2, query_margin=-1.0)


def test_training_keeps_its_best_evaluation_unless_patience_is_zero():
    """By default train-hash ends with the weights of its highest held-out IoU and stops after two evaluations
    without a higher one; patience 0 runs every iteration and keeps the last weights, as the paper."""
    opts = dict(iters=12, hidden=32, nbits=32, keep=16 / 128, lr=3e-2, queries_per_step=8, holdout=0.34,
                eval_every=1)
    _, config, report = train_hashes(ClusteredDump(), **opts)
    run, curve = report["train"], report["train"]["heldout_curve"]
    assert config["train"]["kept"] == "highest held-out iou" and run["kept"]["by"] == "iou"
    best = max(range(len(curve)), key=lambda i: (curve[i][1]["iou"], -i))  # the first of equals
    assert run["kept"]["step"] == curve[best][0] and run["kept"]["value"] == curve[best][1]["iou"]
    assert report["iou"]["mean"]["mlp_after"] == pytest.approx(run["kept"]["value"], abs=1e-4)  # the weights kept
    assert run["stopped_early"] and run["steps"] == curve[best][0] + 2 < 12  # here it peaks, then falls twice
    _, config, report = train_hashes(ClusteredDump(), patience=0, **opts)
    assert config["train"]["kept"] == "last" and "kept" not in report["train"] and report["train"]["steps"] == 12


def test_resume_continues_to_the_same_weights(tmp_path):
    acts = ClusteredDump(seqs=3)
    data = DumpExamples(acts, [0, 1], holdout=0.0)
    obj = SpotlightObjective(data, acts.patterns(), keep=0.125, queries_per_step=8)
    cfg = TrainConfig(iters=12, lr=3e-3, warmup=3, checkpoint_every=5)

    def run(stop_at=None, resume=False):
        model = HashModel(2, 1, 16, 32, 32)

        def loss_at(step):
            if step == stop_at:
                raise KeyboardInterrupt
            return obj.loss(model, step)

        train(model, loss_at, cfg, checkpoint_dir=tmp_path / "ckpt", resume=resume, identity={"run": 1})
        return model

    whole = run()
    with pytest.raises(KeyboardInterrupt):
        run(stop_at=7)  # the interrupt writes a checkpoint at step 7 (not on the every-5 grid)
    assert torch.load(tmp_path / "ckpt" / "checkpoint.pt", weights_only=False)["step"] == 7
    resumed = run(resume=True)
    for a, b in zip(whole.parameters(), resumed.parameters()):
        assert torch.equal(a, b)
    with pytest.raises(SparseKVError, match="another run"):
        model = HashModel(2, 1, 16, 32, 32)
        train(model, lambda s: obj.loss(model, s), cfg, checkpoint_dir=tmp_path / "ckpt", resume=True,
              identity={"run": 2})


def test_learning_rate_schedule():
    cfg = TrainConfig(iters=100, lr=1e-3, warmup=10)
    assert cfg.lr_at(0) == pytest.approx(1e-4) and cfg.lr_at(9) == pytest.approx(1e-3)
    assert cfg.lr_at(55) == pytest.approx(0.5e-3) and cfg.lr_at(100) == pytest.approx(0.0)
    with pytest.raises(SparseKVError):
        TrainConfig(iters=0).check()


def test_per_head_clipping_is_each_heads_own():
    m = HashModel(1, 2, 4, 16, 16)
    for p in m.parameters():
        p.grad = torch.zeros_like(p)
    m.w1.grad[0, 0] = 10.0  # head 0: a large gradient; head 1: a small one
    m.w2.grad[0, 1] = 0.01
    m.clip_grads_(1.0)
    assert m.w1.grad[0, 0].norm() == pytest.approx(1.0, rel=1e-4)
    assert m.w2.grad[0, 1].norm() == pytest.approx(0.01 * math.sqrt(16 * 16), rel=1e-4)


def test_fit_hashes_writes_an_artifact_spotlight_loads(tiny, tmp_path):
    from sparsekv.activations import dump_activations, load_activations
    from sparsekv.methods import get_method

    tokens = torch.randint(0, 256, (3 * 64,), generator=torch.Generator().manual_seed(2)).tolist()
    acts = load_activations(dump_activations(tiny, tokens, tmp_path / "acts", seq_len=64, queries_per_seq=16))
    path, report = fit_hashes(acts, tmp_path / "art", iters=6, hidden=32, nbits=32, queries_per_step=8,
                              checkpoint_every=2, patience=0)
    assert path.parent.name == "spotlight" and not list(path.parent.glob(".train-*"))  # checkpoints gone
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["config"]["nbits"] == 32 and manifest["report"]["train"]["steps"] == 6
    m = get_method("spotlight", budget=16, artifact=str(path))
    assert m.nbits == 32 and m.config()["pooling"] == "group"
    chosen = manifest["config"]["query_margin"]  # train-hash's better margin on its held-out queries
    assert chosen in (0.0, 0.35) and m.config()["query_margin"] == chosen
    assert get_method("spotlight", budget=16, artifact=str(path), query_margin=0.5).config()["query_margin"] == 0.5
    m.bind(tiny)
    other = type("Other", (), {"fingerprint": lambda self: {**tiny.fingerprint(), "num_layers": 3}})()
    with pytest.raises(SparseKVError, match="num_layers"):
        get_method("spotlight", budget=16, artifact=str(path)).bind(other)
    with pytest.raises(SparseKVError, match="train-hash"):
        get_method("spotlight", budget=16)
