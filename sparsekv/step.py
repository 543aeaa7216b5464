"""One decode step (one new token through the model): the eager transformers call, or the same maths as one CUDA
graph, replayed for every token.

Why: a decode step is bound by the CPU when it is launched from Python. SmolLM2 (30 layers) launches ~925 kernels per
token from eager transformers code, far more CPU time than its GPU work takes; with Llama-3-8B's shape at long
context a query-aware method's select and attention, launched eagerly, cost more than the keys they save
(benchmarks/BENCHMARKS.md has the graph-replayed speeds). So the whole step - embedding, every layer's norms, projections, RoPE, K/V write, the method's index
update and select, the sparse attention, the MLP, the head - is captured once per cache and regime and replayed
(vLLM, SGLang and FlashInfer decode the same way). The rules that make a method capturable are in
sparsekv/methods/base.py: lengths and write slots live on the device (`SparseCache.begin_step`), selection regions
are sized to the cache (`SparseCache.set_extent`) and masked on the device, nothing reads a value back to the host.

A graph holds what the host decided when it was captured: for each layer whether its budget is below what it sees
(`SparseCache.regime`). That changes at most once per layer in a generation, when the context outgrows the budget;
a new regime is captured on first use (one eager step that also compiles and allocates, then the capture).
A batch decodes in one step, each row at its own position (`SparseCache.load_row`), its own graphs per batch size.

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

from . import ops
from .attention import decode_attention
from .cache import PRE_ROPE, WRITTEN, SparseCache
from .errors import SparseKVError
from .models import LoadedModel, cache_kwarg
from .patterns import FAMILIES

# (token ids [B, 1], position: one for every row or one per row) -> logits [B, vocab]
StepFn = Callable[[torch.Tensor, "int | list[int]"], torch.Tensor]


def position_ids(pos: int | list[int], batch: int, device: torch.device) -> torch.Tensor:
    """[B, 1] position ids of a decode step: `pos` for every row, or one per row."""
    if isinstance(pos, int):
        return torch.full((batch, 1), pos, dtype=torch.long, device=device)
    return torch.tensor(pos, dtype=torch.long).view(batch, 1).to(device, non_blocking=True)

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
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"MLP activation {cfg.hidden_act!r} (the split step fuses SiLU)"
    norms = [base.norm, *(m for layer in base.layers for m in (layer.input_layernorm, layer.post_attention_layernorm))]
    if not all(hasattr(n, "variance_epsilon") and hasattr(n, "weight") for n in norms):
        return "the model's RMSNorm is not Llama's (weight x normalised input)"
    rope = getattr(base.rotary_emb, "rope_type", "default")
    if "dynamic" in rope or "longrope" in rope:  # their tables change with the length (a host-side check)
        return f"RoPE type {rope!r} recomputes its tables as the context grows"
    return None


class SplitForward:
    """The decode-step forward of a Llama-family model written out, with the elementwise work fused (`sparsekv.ops`:
    a residual add with the next RMSNorm, RoPE of q and k, SiLU(gate) x up: one kernel each on a GPU, the eager
    arithmetic elsewhere), the linear layers through `ops.linear` (a GEMV kernel for a step's few rows) and each
    layer's attention through `attend` (cache update, the method's select, the sparse-decode call)."""

    def __init__(self, lm: LoadedModel):
        self.lm = lm
        self.causal = lm.model
        self.base = lm.model.model
        self.layers = list(self.base.layers)
        # one matrix-vector product for q, k and v, one for gate and up: fewer, larger GEMVs read the weights
        # closer to copy bandwidth (the small k and v products alone are far from it)
        self.qkv_w = [_joined(layer.self_attn, ("q_proj", "k_proj", "v_proj")) for layer in self.layers]
        self.gate_up_w = [_joined(layer.mlp, ("gate_proj", "up_proj")) for layer in self.layers]

    def qkv(self, i: int, x: torch.Tensor):
        """Layer i's q [B, Hq, 1, D], k, v [B, Hkv, 1, D] of its normalised input x [B, 1, hidden], q and k before
        RoPE (what a method that indexes pre-RoPE vectors reads, exactly and for free; `attend` rotates them)."""
        attn = self.layers[i].self_attn
        shape = (*x.shape[:-1], -1, attn.head_dim)
        if self.qkv_w[i] is not None:
            w, b = self.qkv_w[i]
            q, k, v = ops.linear(x, w, b).split([m.out_features for m in (
                attn.q_proj, attn.k_proj, attn.v_proj)], dim=-1)
            q, k, v = q.view(shape), k.view(shape), v.view(shape)
        else:
            q, k, v = (_linear(p, x).view(shape) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
        if hasattr(attn, "q_norm"):  # qwen3 normalises q and k per head before RoPE
            q = ops.rms_norm(q, attn.q_norm.weight, attn.q_norm.variance_epsilon)[0]
            k = ops.rms_norm(k, attn.k_norm.weight, attn.k_norm.variance_epsilon)[0]
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def mlp(self, i: int, x: torch.Tensor) -> torch.Tensor:
        m = self.layers[i].mlp
        if self.gate_up_w[i] is not None:
            w, b = self.gate_up_w[i]
            gate, up = ops.linear(x, w, b).chunk(2, dim=-1)
        else:
            gate, up = _linear(m.gate_proj, x), _linear(m.up_proj, x)
        return _linear(m.down_proj, ops.silu_mul(gate, up))

    def attend(self, i: int, cache: SparseCache, q_pre, k_pre, v, cos, sin) -> torch.Tensor:
        """Layer i's RoPE, cache update and attention (the method's select included) -> [B, 1, Hq * D]. With the
        layer's buffers in place (after a prefill), RoPE of q and k and the K/V write are one launch."""
        layer = cache.layers[i]
        if layer.is_initialized:
            q, k = ops.rope_write_kv(q_pre, k_pre, v, cos, sin, layer.keys, layer.values, cache.slots)
            cache.update(k, v, i, {PRE_ROPE: k_pre, WRITTEN: True})
        else:
            q, k = ops.rope(q_pre, cos, sin), ops.rope(k_pre, cos, sin)
            cache.update(k, v, i, {PRE_ROPE: k_pre})
        out = decode_attention(cache, i, q, q_pre)
        return out.reshape(*out.shape[:2], -1)

    def forward(self, cache: SparseCache, token: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Logits [B, vocab] of tokens [B, 1] at position ids [B, 1]; the cache's begin_step has been called. The
        residual stream h takes each sublayer's output in the next RMSNorm's fused add."""
        h = self.base.embed_tokens(token)
        cos, sin = self.base.rotary_emb(h, pos)
        out = None  # the last sublayer's output, not yet added to h
        for i, layer in enumerate(self.layers):
            ln = layer.input_layernorm
            x, h = ops.rms_norm(h if out is None else out, ln.weight, ln.variance_epsilon, None if out is None else h)
            o = _linear(layer.self_attn.o_proj, self.attend(i, cache, *self.qkv(i, x), cos, sin))
            ln = layer.post_attention_layernorm
            x, h = ops.rms_norm(o, ln.weight, ln.variance_epsilon, h)
            out = self.mlp(i, x)
        x, _ = ops.rms_norm(out, self.base.norm.weight, self.base.norm.variance_epsilon, h)
        return _linear(self.causal.lm_head, x)[:, -1]

    @torch.no_grad()
    def step(self, cache: SparseCache, token: torch.Tensor, pos: int | list[int]) -> torch.Tensor:
        """The whole step eagerly (the CPU path of the tests; a graph replays the same calls)."""
        cache.begin_step(pos)
        token = token.view(-1, 1)
        return self.forward(cache, token, position_ids(pos, token.shape[0], token.device))


def _linear(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A linear layer of the step through `ops.linear` (the GEMV kernel at a decode step's few rows); other modules
    (quantised layers, adapters) as they are."""
    if type(module) is torch.nn.Linear:
        return ops.linear(x, module.weight, module.bias)
    return module(x)


def _joined(module: torch.nn.Module, names: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The weights (and biases) of `module`'s linear layers `names` as one matrix whose rows are theirs, in order:
    the layers' own parameters become views of it (no second copy; the model computes exactly as before), and it is
    kept on the module for the next step function. None where they cannot be joined (other devices or dtypes)."""
    linears = [getattr(module, n, None) for n in names]
    if not all(isinstance(m, torch.nn.Linear) for m in linears):
        return None
    kept = getattr(module, "_sparsekv_joined", None)
    if kept is not None and kept[0].data_ptr() == linears[0].weight.data_ptr():  # not moved or cast since
        return kept
    ws = [m.weight for m in linears]
    biases = [m.bias for m in linears]
    if len({(w.device, w.dtype, w.shape[1]) for w in ws}) != 1 or len({b is None for b in biases}) != 1:
        return None
    kept = (_rows_of_one(ws), None if biases[0] is None else _rows_of_one(biases))
    module._sparsekv_joined = kept
    return kept


def _rows_of_one(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """One tensor whose consecutive rows are the parameters' data; each parameter's data becomes a view of it."""
    whole = torch.cat([p.data for p in params], dim=0)
    start = 0
    for p in params:
        p.data = whole[start : start + p.shape[0]]
        start += p.shape[0]
    return whole


class StepGraph:
    """The whole decode step over one cache as CUDA graphs, one per regime (module docstring); replays read the
    token and position from two small device buffers and every length from the cache's device lengths."""

    def __init__(self, split: SplitForward, cache: SparseCache):
        dev = split.lm.device
        self.split, self.cache = split, cache
        self.token: torch.Tensor | None = None  # [B, 1], made at the first step (its batch size)
        self.pos: torch.Tensor | None = None
        self.device = dev
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor, list]] = {}
        cache.set_extent(cache.max_len)  # every step, eager or replayed, selects over regions sized to the cache

    @torch.no_grad()
    def step(self, token: torch.Tensor, pos: int | list[int]) -> torch.Tensor:
        """Logits [B, vocab] for tokens [B, 1] at `pos` (one for every row, or one per row): the graph's own
        output, valid until the next step."""
        c = self.cache
        c.begin_step(pos)
        token = token.view(-1, 1)
        if self.token is None:
            self.token = torch.zeros_like(token, device=self.device)
            self.pos = torch.zeros_like(self.token)
        self.token.copy_(token)
        self.pos.copy_(position_ids(pos, token.shape[0], self.device))
        regime = c.regime()
        hit = self.graphs.get(regime)
        if hit is None:
            return self._capture(regime)
        graph, out, entries = hit
        graph.replay()
        c.stats.replay(entries, c.step_pos + 1)
        return out

    def _capture(self, regime: tuple) -> torch.Tensor:
        """Run this step eagerly on a side stream (it compiles kernels and allocates their scratch, as
        torch.cuda.graph asks), then capture it; the eager run's logits are this step's."""
        c, dev = self.cache, self.device
        side = torch.cuda.Stream(device=dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            logits = self.split.forward(c, self.token, self.pos).clone()
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        c.stats.captured = []
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                out = self.split.forward(c, self.token, self.pos)
        finally:
            entries, c.stats.captured = c.stats.captured, None
        self.graphs[regime] = (graph, out, entries)
        return logits


def _eager_step(lm: LoadedModel, cache: SparseCache) -> StepFn:
    given = cache_kwarg(lm.model, cache)

    def step(token: torch.Tensor, pos: int | list[int]) -> torch.Tensor:
        cache.begin_step(pos)
        token = token.view(-1, 1)
        p = position_ids(pos, token.shape[0], token.device)
        return lm.model(input_ids=token, **given, position_ids=p, use_cache=True).logits[:, -1]

    return step


MODES = ("eager", "split", "static", "graph")


def decode_path(lm: LoadedModel, mode: str | None = None) -> tuple[str, str | None]:
    """(mode, why the faster path is not taken or None) for `make_step`. mode: "eager" (the transformers call),
    "split" (the split forward, no graphs: for tests on the CPU), "static" (the split forward exactly as a graph
    replays it: regions sized to the cache and masked from the device lengths; for tests), "graph", or None: graphs
    on CUDA when the model allows and SPARSEKV_GRAPHS is not 0, else eager."""
    flag = os.environ.get("SPARSEKV_GRAPHS", "")
    if mode not in (None, *MODES):
        raise SparseKVError(f"unknown decode-step mode {mode!r}: use {', '.join(MODES)}")
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
    split = SplitForward(lm)
    if mode in ("split", "static"):
        cache.set_extent(cache.max_len if mode == "static" else None)
        return lambda token, pos: split.step(cache, token, pos)
    if lm.device.type != "cuda":
        raise SparseKVError("CUDA graphs (asked for by SPARSEKV_GRAPHS=1 or mode='graph') need the model on a CUDA "
                            "device")
    graphed = StepGraph(split, cache)
    return graphed.step
