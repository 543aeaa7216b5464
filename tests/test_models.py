"""Model loading: the in-memory tiny model wired to the `sparsekv` attention, one clear line for a spec that is no
model, and a fingerprint that identifies the weights (not how they were loaded)."""

import pytest
import torch

from sparsekv.attention import NAME
from sparsekv.errors import SparseKVError
from sparsekv.models import load_model


def test_tiny_random_is_wired_to_sparsekv():
    lm = load_model("tiny-random")
    assert (lm.num_layers, lm.q_heads, lm.kv_heads, lm.head_dim) == (2, 6, 2, 20)
    assert lm.model.config._attn_implementation == NAME and not lm.model.training
    assert lm.device == torch.device("cpu") and lm.max_context > 0 and len(lm.patterns) == lm.num_layers


@pytest.mark.parametrize("spec,message", [("no-such-model", "unknown model 'no-such-model'"),
                                          ("{tmp}/model.gguf", "model file not found"),
                                          ("{tmp}/dir", "no such folder"), ("./{tmp}/a/b", "no such folder")])
def test_a_spec_that_is_no_model_is_one_line(spec, message, tmp_path):
    with pytest.raises(SparseKVError, match=message):
        load_model(spec.format(tmp=tmp_path / "absent"))


def test_a_folder_that_does_not_load_is_one_line(tmp_path):
    """A model folder transformers cannot load (here: weights and config but no tokenizer, a ValueError with a
    multi-line message) is one line naming the folder, not a traceback."""
    from sparsekv.models import tiny_random

    tiny_random().model.save_pretrained(tmp_path)
    with pytest.raises(SparseKVError, match=r"^cannot load model '.+': \S") as e:
        load_model(str(tmp_path))
    assert "\n" not in str(e.value) and len(str(e.value)) < 400


def test_fingerprint_is_stable_across_loads():
    a, b = load_model("tiny-random"), load_model("tiny-random")
    assert a.fingerprint() == b.fingerprint()
    assert set(a.fingerprint()) == {"name", "num_layers", "q_heads", "kv_heads", "head_dim", "rope", "weights_sha256"}


def test_fingerprint_is_the_same_for_fp32_and_bf16_loads():
    """Calibrate on a CPU in fp32, run on a GPU in bf16: the artifact must still match its model."""
    a, b = load_model("tiny-random"), load_model("tiny-random", dtype=torch.bfloat16)
    assert a.fingerprint() == b.fingerprint()
    with torch.no_grad():
        b.model.model.layers[0].mlp.down_proj.weight[0, 0] += 0.5  # a fine-tune changes it
    assert b.fingerprint()["weights_sha256"] != a.fingerprint()["weights_sha256"]
