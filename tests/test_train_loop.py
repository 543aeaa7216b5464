"""The shared offline training loop: the weights of the best held-out evaluation, early stopping, resuming a run
that tracks them, and the matrix-product precision of its parts."""

import pytest
import torch

from sparsekv.errors import SparseKVError
from sparsekv.offline.precision import tf32_matmul
from sparsekv.offline.train import TrainConfig, train


class Scripted:
    """A small regression whose held-out metric follows a script (one value per evaluation), so the evaluation that
    is best, and when patience runs out, are known; it records the weights at every evaluation."""

    def __init__(self, script):
        torch.manual_seed(0)
        self.model = torch.nn.Linear(4, 1)
        self.x, self.y = torch.randn(32, 4), torch.randn(32, 1)
        self.script, self.seen = list(script), {}
        self.flags = {"loss": set(), "eval": set()}

    def loss_at(self, step):
        self.flags["loss"].add(torch.backends.cuda.matmul.allow_tf32)
        return ((self.model(self.x + step * 0.01) - self.y) ** 2).mean()

    def evaluate(self):
        self.flags["eval"].add(torch.backends.cuda.matmul.allow_tf32)
        i = len(self.seen)
        self.seen[i] = [p.detach().clone() for p in self.model.parameters()]
        return {"kl": self.script[i]}


def test_the_run_keeps_the_best_evaluation_and_stops_when_patience_runs_out():
    s = Scripted([5.0, 3.0, 4.0, 4.5, 1.0])  # best at the 2nd evaluation (step 20); two worse ones: stop at step 40
    cfg = TrainConfig(iters=100, lr=1e-2, warmup=0, eval_every=10, best_by="kl", patience=2)
    run = train(s.model, s.loss_at, cfg, evaluate=s.evaluate)
    assert run.steps == 40 and run.stopped_early and len(s.seen) == 4
    assert run.report()["kept"] == {"by": "kl", "step": 20, "value": 3.0}
    for a, b in zip(s.model.parameters(), s.seen[1]):
        assert torch.equal(a, b)
    assert not torch.equal(s.seen[1][0], s.seen[3][0])  # the weights moved after the best one


@pytest.mark.parametrize("mode,script", [("min", [1.0, 0.9, 0.89, 0.885, 0.5]), ("max", [1.0, 1.1, 1.11, 1.115, 2.0])])
def test_min_delta_stops_a_plateau_and_keeps_the_last_real_gain(mode, script):
    """A 10 % gain counts; the next two values, better but within 2 % of that best, do not under min_delta 2 %: the
    run stops at the 4th evaluation with the 2nd one's weights. Without min_delta each of them is a new best."""
    s = Scripted(script)
    cfg = TrainConfig(iters=100, lr=1e-2, warmup=0, eval_every=10, best_by="kl", best_mode=mode, patience=2,
                      min_delta=0.02)
    run = train(s.model, s.loss_at, cfg, evaluate=s.evaluate)
    assert run.steps == 40 and run.stopped_early and run.report()["kept"] == {"by": "kl", "step": 20,
                                                                             "value": script[1]}
    for a, b in zip(s.model.parameters(), s.seen[1]):
        assert torch.equal(a, b)
    s = Scripted(script)
    run = train(s.model, s.loss_at, TrainConfig(iters=50, lr=1e-2, warmup=0, eval_every=10, best_by="kl",
                                                best_mode=mode, patience=2), evaluate=s.evaluate)
    assert run.steps == 50 and run.report()["kept"]["step"] == 50
    with pytest.raises(SparseKVError, match="--min-delta"):
        TrainConfig(min_delta=1.0).check()


def test_without_patience_the_run_goes_on_and_still_keeps_the_best():
    s = Scripted([5.0, 3.0, 4.0, 4.5, 6.0])
    cfg = TrainConfig(iters=50, lr=1e-2, warmup=0, eval_every=10, best_by="kl", best_mode="min")
    run = train(s.model, s.loss_at, cfg, evaluate=s.evaluate)
    assert run.steps == 50 and not run.stopped_early and run.report()["kept"]["step"] == 20
    s = Scripted([5.0, 3.0, 4.0, 4.5, 6.0])
    run = train(s.model, s.loss_at, TrainConfig(iters=50, lr=1e-2, warmup=0, eval_every=10, best_by="kl",
                                               best_mode="max"), evaluate=s.evaluate)
    assert run.report()["kept"]["step"] == 50  # higher is better
    s = Scripted([1.0])
    assert "kept" not in train(s.model, s.loss_at, TrainConfig(iters=5, warmup=0), evaluate=s.evaluate).report()


def test_a_resumed_run_stops_and_keeps_the_same_weights(tmp_path):
    cfg = TrainConfig(iters=100, lr=1e-2, warmup=0, eval_every=10, best_by="kl", patience=2, checkpoint_every=7)
    script = [5.0, 3.0, 4.0, 4.5]
    whole = Scripted(script)
    train(whole.model, whole.loss_at, cfg, evaluate=whole.evaluate, checkpoint_dir=tmp_path / "a")

    part = Scripted(script)

    def stop_at_33(step):
        if step == 33:  # after the best evaluation (20), before patience runs out (40)
            raise KeyboardInterrupt
        return part.loss_at(step)

    with pytest.raises(KeyboardInterrupt):
        train(part.model, stop_at_33, cfg, evaluate=part.evaluate, checkpoint_dir=tmp_path / "b")
    again = Scripted(script[3:])  # the evaluations left: the one at step 40
    again.model.load_state_dict(part.model.state_dict())
    run = train(again.model, again.loss_at, cfg, evaluate=again.evaluate, checkpoint_dir=tmp_path / "b", resume=True)
    assert run.steps == 40 and run.stopped_early and run.report()["kept"]["step"] == 20
    for a, b in zip(whole.model.parameters(), again.model.parameters()):
        assert torch.equal(a, b)


def test_precision_tf32_for_the_model_full_fp32_for_evaluations_restored_after():
    before = torch.backends.cuda.matmul.allow_tf32
    s = Scripted([1.0, 2.0])
    train(s.model, s.loss_at, TrainConfig(iters=4, warmup=0, eval_every=2, tf32=True), evaluate=s.evaluate)
    assert s.flags == {"loss": {True}, "eval": {False}}
    assert torch.backends.cuda.matmul.allow_tf32 == before
    with pytest.raises(RuntimeError):
        with tf32_matmul(not before):
            raise RuntimeError
    assert torch.backends.cuda.matmul.allow_tf32 == before


def test_patience_needs_a_metric():
    with pytest.raises(SparseKVError, match="patience"):
        TrainConfig(patience=2).check()
    with pytest.raises(SparseKVError, match="patience"):
        TrainConfig(best_by="kl", best_mode="lowest").check()


@pytest.mark.parametrize("cfg,message", [
    (dict(lr=0.0), "--lr must be a finite number > 0, got 0.0"),
    (dict(lr=float("nan")), "--lr must be a finite number > 0, got nan"),
    (dict(min_lr=-1.0), "min_lr must be a finite number >= 0, got -1.0"),
    (dict(eval_every=-1), "--checkpoint-every and --eval-every must be >= 0, got 512 and -1"),
    (dict(iters=0), "--iters must be >= 1, got 0"),
])
def test_each_bad_setting_is_named(cfg, message):
    with pytest.raises(SparseKVError) as e:
        TrainConfig(**cfg).check()
    assert message in str(e.value)
