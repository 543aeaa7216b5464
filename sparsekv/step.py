"""One decode step (one new token through the model): the eager transformers call, or the same maths split at
attention with every piece between two attention calls replayed as a CUDA graph.

Why: a decode step of a small model is bound by the CPU. SmolLM2 (30 layers) launches ~925 kernels per token from
eager transformers code, ~45 ms of CPU for ~2.3 ms of GPU work on the H100 machine
(results/decode-token-cost-h100.json). Whole-step graphs would need every method's `select` written for a
device-side length; instead we split the step where attention happens (vLLM's "piecewise" graphs). The pieces -
embedding, norms, projections, RoPE, MLP, the head - hold no per-step Python state, so each is captured once per
model and replayed for every prompt and method; cache update, the method's select and the sparse-decode call stay
eager, exactly the code the transformers path runs (`sparsekv_attention`).

The split forward is written for the Llama family (llama, mistral, qwen2, qwen3, sliding windows included; not a
RoPE whose tables change with the length): the transformers layer code it mirrors is short and shared by those
models, and attention goes through `attention.decode_attention`, which reads each layer's window from the cache.
Anything else takes the eager call; on a GPU that is said once on stderr, and every result records its
`decode_path`.
SPARSEKV_GRAPHS=0 turns graphs off (the eager call everywhere); =1 asks for them and fails if they cannot run.
"""

from __future__ import annotations

import os
import sys
from typing import Callable

import torch

from .attention import decode_attention
from .cache import SparseCache
from .errors import SparseKVError
from .models import LoadedModel
from .patterns import FAMILIES

StepFn = Callable[[torch.Tensor, int], torch.Tensor]  # (token ids [1, 1], position) -> logits [1, vocab]

SPLIT_FAMILIES = tuple(k for k, f in FAMILIES.items() if f.split)


def split_supported(lm: LoadedModel) -> str | None:
    """None when the split forward can run `lm`, else why not."""
    cfg = lm.config
    kind = getattr(cfg, "model_type", "")
    if kind not in SPLIT_FAMILIES:
        return f"the split decode step covers the Llama family ({', '.join(SPLIT_FAMILIES)}), not {kind!r}"
    base = getattr(lm.model, "model", None)
    need = ("embed_tokens", "layers", "norm", "rotary_emb")
    if base is None or not all(hasattr(base, a) for a in need) or not hasattr(lm.model, "lm_head"):
        return "the model does not have the Llama module layout"
    rope = getattr(base.rotary_emb, "rope_type", "default")
    if "dynamic" in rope or "longrope" in rope:  # their tables change with the length (a host-side check)
        return f"RoPE type {rope!r} recomputes its tables as the context grows"
    return None


class SplitForward:
    """The decode-step forward of a Llama-family model in pieces that end where attention starts.

    piece 0: token, position -> hidden, (cos, sin), layer 0's q/k/v
    piece i: layer i-1's attention output -> hidden, layer i's q/k/v        (1 <= i < L)
    piece L: layer L-1's attention output -> logits
    Between pieces `attend` runs layer i's cache update and attention, eagerly.
    """

    def __init__(self, lm: LoadedModel):
        self.lm = lm
        self.causal = lm.model
        self.base = lm.model.model
        self.layers = list(self.base.layers)
        self.rope = sys.modules[type(self.layers[0].self_attn).__module__].apply_rotary_pos_emb

    def qkv(self, i: int, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        layer = self.layers[i]
        attn = layer.self_attn
        x = layer.input_layernorm(hidden)
        shape = (*x.shape[:-1], -1, attn.head_dim)
        q, k, v = attn.q_proj(x).view(shape), attn.k_proj(x).view(shape), attn.v_proj(x).view(shape)
        if hasattr(attn, "q_norm"):  # qwen3 normalises q and k per head before RoPE
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = self.rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        return q, k, v.transpose(1, 2)

    def after_attention(self, i: int, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        layer = self.layers[i]
        hidden = hidden + layer.self_attn.o_proj(attn_out)
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))

    def piece(self, i: int, *inputs):
        L = len(self.layers)
        if i == 0:
            token, pos = inputs
            hidden = self.base.embed_tokens(token)
            cos, sin = self.base.rotary_emb(hidden, pos)
            return (hidden, cos, sin, *self.qkv(0, hidden, cos, sin))
        hidden, cos, sin, attn_out = inputs
        hidden = self.after_attention(i - 1, hidden, attn_out)
        if i == L:
            return (self.causal.lm_head(self.base.norm(hidden))[:, -1],)
        return (hidden, *self.qkv(i, hidden, cos, sin))

    def attend(self, i: int, cache: SparseCache, q, k, v) -> torch.Tensor:
        """Layer i's cache update and attention (the method's select included) -> [1, 1, Hq * D]."""
        cache.update(k, v, i)
        out = decode_attention(cache, i, q)
        return out.reshape(*out.shape[:2], -1)

    @torch.no_grad()
    def step(self, cache: SparseCache, token: torch.Tensor, pos: int) -> torch.Tensor:
        """The whole step, every piece eager (the CPU path of the tests; graphs replay the same pieces)."""
        p = torch.tensor([[pos]], device=token.device)
        hidden, cos, sin, q, k, v = self.piece(0, token, p)
        for i in range(1, len(self.layers) + 1):
            out = self.piece(i, hidden, cos, sin, self.attend(i - 1, cache, q, k, v))
            if i < len(self.layers):
                hidden, q, k, v = out
        return out[0]


class GraphedForward:
    """SplitForward with each piece captured as a CUDA graph once; replays run the step for any cache."""

    @torch.no_grad()
    def __init__(self, split: SplitForward, warmup: int = 2):
        lm = split.lm
        dev, dtype = lm.device, next(lm.model.parameters()).dtype
        self.split = split
        L, Hq, D = len(split.layers), lm.q_heads, lm.head_dim
        self.token = torch.zeros(1, 1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(1, 1, dtype=torch.long, device=dev)
        # where the eager attention of layer i writes its output, read by piece i + 1
        self.attn_in = [torch.zeros(1, 1, Hq * D, dtype=dtype, device=dev) for _ in range(L)]
        self.key = weights_key(lm)
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.outs: list[tuple] = []
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(device=dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # warm-up off the capture stream, as torch.cuda.graph's docs ask
            for _ in range(warmup):
                warm: list[tuple] = []
                for i in range(L + 1):
                    warm.append(split.piece(i, *self._inputs(i, warm)))
        torch.cuda.current_stream(dev).wait_stream(side)
        for i in range(L + 1):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                out = split.piece(i, *self._inputs(i, self.outs))
            self.graphs.append(g)
            self.outs.append(out)
        torch.cuda.synchronize(dev)

    def _inputs(self, i: int, outs: list[tuple]) -> tuple:
        if i == 0:
            return self.token, self.pos
        return outs[i - 1][0], outs[0][1], outs[0][2], self.attn_in[i - 1]

    @torch.no_grad()
    def step(self, cache: SparseCache, token: torch.Tensor, pos: int) -> torch.Tensor:
        """Logits [1, vocab] for `token` at `pos`; the tensor is the graph's own output, valid until the next step."""
        self.token.copy_(token.view(1, 1))
        self.pos.fill_(pos)
        split, outs, L = self.split, self.outs, len(self.split.layers)
        for i in range(L):
            self.graphs[i].replay()
            q, k, v = outs[i][-3:]
            self.attn_in[i].copy_(split.attend(i, cache, q, k, v))
        self.graphs[L].replay()
        return outs[L][0]


def weights_key(lm: LoadedModel) -> tuple:
    """What captured graphs depend on: they read the weights at fixed addresses, so a model moved or cast since
    (new tensors: `.to()` replaces every parameter, so the first and last tell) must be captured again."""
    params = list(lm.model.parameters())
    return tuple((p.device, p.dtype, p.data_ptr()) for p in (params[0], params[-1]))


def _eager_step(lm: LoadedModel, cache: SparseCache) -> StepFn:
    def step(token: torch.Tensor, pos: int) -> torch.Tensor:
        p = torch.tensor([[pos]], device=token.device)
        return lm.model(input_ids=token.view(1, 1), past_key_values=cache, position_ids=p,
                        use_cache=True).logits[:, -1]

    return step


def decode_path(lm: LoadedModel, mode: str | None = None) -> tuple[str, str | None]:
    """(mode, why the faster path is not taken or None) for `make_step`. mode: "eager" (the transformers call),
    "split" (the split forward, no graphs: for tests on the CPU), "graph", or None: graphs on CUDA when the model
    allows and SPARSEKV_GRAPHS is not 0, else eager."""
    flag = os.environ.get("SPARSEKV_GRAPHS", "")
    if mode not in (None, "eager", "split", "graph"):
        raise SparseKVError(f"unknown decode-step mode {mode!r}: use eager, split or graph")
    why = split_supported(lm)
    if mode is not None:
        if mode != "eager" and why is not None:
            raise SparseKVError(f"the split decode step cannot run this model: {why}")
        return mode, None
    if flag == "1":
        if why is not None:
            raise SparseKVError(f"the split decode step cannot run this model: {why}")
        return "graph", None
    if flag == "0":
        return "eager", "SPARSEKV_GRAPHS=0"
    if lm.device.type != "cuda":
        return "eager", "CUDA graphs need a GPU"
    return ("eager", why) if why is not None else ("graph", None)


def make_step(lm: LoadedModel, cache: SparseCache, mode: str | None = None) -> StepFn:
    """The decode-step function for `lm` and `cache` (modes: `decode_path`). Records the path taken in the cache's
    statistics; a GPU run that cannot take the graphed path says so once per model on stderr."""
    mode, why = decode_path(lm, mode)
    cache.stats.decode_path = mode if why is None else f"{mode} ({why})"
    if mode == "eager":
        if why is not None and lm.device.type == "cuda" and not lm.told_eager:
            print(f"sparsekv: decoding eagerly, without CUDA graphs (slower): {why}", file=sys.stderr)
            lm.told_eager = True
        return _eager_step(lm, cache)
    if mode == "split":
        split = SplitForward(lm)
        return lambda token, pos: split.step(cache, token, pos)
    if lm.device.type != "cuda":
        raise SparseKVError("CUDA graphs (asked for by SPARSEKV_GRAPHS=1 or mode='graph') need the model on a CUDA "
                            "device")
    graphed = lm.graphs
    if graphed is None or graphed.key != weights_key(lm):
        graphed = lm.graphs = GraphedForward(SplitForward(lm))
    return lambda token, pos: graphed.step(cache, token, pos)
