"""One decode step of one layer, per method: the unit `sparsekv bench` times.

The cache holds `seq - 1` random keys (torch.randn: zeros would make every score tie) and the method's index of
them, built by `method.append` in chunks, as prefill would. The step is what decode does for one layer: write the
new token's K/V at position seq - 1, `method.append` it, `method.select`, `sparse_decode` over the selection, so
after it the context is exactly `seq` keys. The dense baselines write the token and attend the whole cache: torch
SDPA with native GQA (each KV head read once for its group) and our split-K flash-decoding kernel. Every row says
which backend or kernel ran.

Each timed call rewinds the valid length to seq - 1 first, so repeated runs repeat the same step (a method's
append must be idempotent at a fixed position, which writing index entries in place is).
"""

from __future__ import annotations

import copy
import os
import warnings
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..errors import SparseKVError
from ..methods import REGISTRY, CacheShape, LayerState, get_method, method_names
from ..selection import Selection
from .. import ops
from .floor import floor_us
from .shapes import Shape
from .timing import Timing, plan_rotation, time_steps
from .traffic import Traffic, dense_traffic, select_read_bytes, step_traffic

DENSE_BASELINES = ("sdpa", "flashdecode")
INDEX_CHUNK = 8192  # keys per method.append while building the index: bounds its temporaries


@dataclass
class Inputs:
    """One copy of everything a step touches (copies are rotated so timings do not read from L2)."""

    keys: torch.Tensor  # [B, Hkv, seq, D]
    values: torch.Tensor
    q: torch.Tensor  # [B, Hq, 1, D]
    k_new: torch.Tensor  # [B, Hkv, 1, D]
    v_new: torch.Tensor
    state: LayerState | None = None
    sel: Selection | None = field(default=None, repr=False)

    def extra_bytes(self) -> int:
        """Device bytes of one more copy."""
        n = 2 * self.keys.numel() * self.keys.element_size()
        if self.state is not None:
            seen = {self.keys.untyped_storage().data_ptr(), self.values.untyped_storage().data_ptr()}
            for t in vars(self.state).values():
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                    seen.add(t.untyped_storage().data_ptr())
                    n += t.untyped_storage().nbytes()
        return n


def random_inputs(shape: Shape, seq: int, batch: int, dtype: torch.dtype, device: torch.device,
                  seed: int = 0) -> Inputs:
    g = torch.Generator(device=device).manual_seed(seed)
    kv = (batch, shape.kv_heads, seq, shape.head_dim)
    new = (batch, shape.kv_heads, 1, shape.head_dim)
    r = lambda *s: torch.randn(*s, generator=g, dtype=dtype, device=device)
    return Inputs(r(*kv), r(*kv), r(batch, shape.q_heads, 1, shape.head_dim), r(*new), r(*new))


def copy_inputs(x: Inputs) -> Inputs:
    keys, values = x.keys.clone(), x.values.clone()
    state = None
    if x.state is not None:  # the method's index comes along; keys/values map to the new copies
        state = copy.deepcopy(x.state, memo={id(x.keys): keys, id(x.values): values})
    return Inputs(keys, values, x.q.clone(), x.k_new.clone(), x.v_new.clone(), state)


def build_index(method, x: Inputs, shape: Shape, seq: int) -> LayerState:
    """The method's state over the first seq - 1 keys, appended chunk by chunk as prefill would."""
    B = x.keys.shape[0]
    st = method.new_state(0, CacheShape(B, shape.kv_heads, shape.q_heads, shape.head_dim, seq, x.keys.dtype,
                                        x.keys.device))
    st.keys, st.values, st.length = x.keys, x.values, 0
    pre = method.needs_pre_rope  # random keys: the "pre-RoPE" copy is the same random data
    for pos in range(0, seq - 1, INDEX_CHUNK):
        n = min(INDEX_CHUNK, seq - 1 - pos)
        k, v = x.keys[:, :, pos:pos + n], x.values[:, :, pos:pos + n]
        st.length = pos + n
        method.append(st, k, v, k if pre else None, pos)
    st.length = seq - 1
    return st


def kernel_backends(device: torch.device) -> dict:
    """Which implementation runs the attention: the Triton kernels when they import (on a GPU), else the torch
    reference, with the import error kept for the result."""
    out = {"sparse_decode": "torch-reference", "dense_decode": "torch-reference", "topk": "torch.topk", "errors": {}}
    if not ops.use_kernels(device):
        out["reason"] = "no CUDA device" if device.type != "cuda" else "kernels turned off (SPARSEKV_KERNELS=0)"
        return out
    tag = "triton (interpreter)" if os.environ.get("TRITON_INTERPRET") == "1" else "triton"
    for name in ("sparse_decode", "dense_decode"):
        try:
            mod = __import__("sparsekv.kernels.sparse_decode", fromlist=[name])
            getattr(mod, name)
            out[name] = tag
        except Exception as e:  # a kernel not landed yet: time the torch path and say so
            out["errors"][name] = f"{type(e).__name__}: {e}"[:300]
    try:
        from sparsekv.kernels.topk import describe_default

        out["topk"] = f"{tag} ({describe_default()})"
    except Exception as e:
        out["errors"]["topk"] = f"{type(e).__name__}: {e}"[:300]
    return out


class DecodeBench:
    """Rows for one (shape, seq, batch, dtype, device): dense baselines and methods, timed on shared random data."""

    def __init__(self, shape: Shape, seq: int, batch: int, dtype: torch.dtype, device: torch.device,
                 copy_gbps: float, kernels: dict, seed: int = 0):
        self.shape, self.seq, self.batch, self.dtype, self.device = shape, seq, batch, dtype, device
        self.copy_gbps, self.kernels = copy_gbps, kernels
        self.scale = shape.head_dim ** -0.5
        self.itemsize = torch.empty((), dtype=dtype).element_size()
        self.base = random_inputs(shape, seq, batch, dtype, device, seed)

    # -- the steps ---------------------------------------------------------------------------------------------
    def _write(self, x: Inputs) -> None:
        p = self.seq - 1
        x.keys.narrow(2, p, 1).copy_(x.k_new)
        x.values.narrow(2, p, 1).copy_(x.v_new)

    def _method_step(self, method, x: Inputs):
        L, st, pre = self.seq, x.state, method.needs_pre_rope
        # the new key's write slot on the device, as a decode step hands it to `append` (a host position is a
        # prefill chunk's, which some methods index by another path)
        slots = torch.full((self.batch,), L - 1, dtype=torch.int32, device=self.device)

        def step():
            st.length = L - 1
            self._write(x)
            st.length = L
            method.append(st, x.k_new, x.v_new, x.k_new if pre else None, slots)
            sel = method.select(st, x.q, x.q if pre else None)
            return ops.sparse_decode(x.q, x.keys, x.values, sel, self.scale)

        return step

    def _attend_only(self, x: Inputs):
        return lambda: ops.sparse_decode(x.q, x.keys, x.values, x.sel, self.scale)

    def _sdpa_step(self, x: Inputs, backend, expand: bool):
        from torch.nn.attention import sdpa_kernel

        G, L = self.shape.group, self.seq

        def step():
            self._write(x)
            k, v = x.keys[:, :, :L], x.values[:, :, :L]
            if expand:  # what GQA costs without native support: a copy of K and V per step
                k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(x.q, k, v, scale=self.scale, enable_gqa=G > 1 and not expand)

        return step

    def _flashdecode_step(self, x: Inputs):
        L = self.seq
        attend = lambda: ops.dense_decode(x.q, x.keys, x.values, L, self.scale)

        def step():
            self._write(x)
            return attend()

        return step

    def pick_sdpa(self) -> tuple[str, object, bool]:
        """The first SDPA backend that accepts this GQA decode shape: native GQA first (flash, efficient, cuDNN),
        then those backends on K/V expanded to every query head, then the math backend."""
        from torch.nn.attention import SDPBackend

        native = [("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                  ("cudnn", SDPBackend.CUDNN_ATTENTION)]
        tries = [(n, b, False) for n, b in native]
        if self.shape.group > 1:
            tries += [(f"{n}+repeat_interleave", b, True) for n, b in native[:2]]
        tries.append(("math", SDPBackend.MATH, False))
        for name, backend, expand in tries:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    self._sdpa_step(self.base, backend, expand)()
                return name, backend, expand
            except RuntimeError:
                continue
        raise SparseKVError("no torch SDPA backend accepts this shape")  # math always should

    # -- rows ----------------------------------------------------------------------------------------------------
    def _copies(self, x: Inputs, working_set: int) -> tuple[list[Inputs], bool, str]:
        n, how = plan_rotation(working_set, x.extra_bytes(), self.device)
        return [x] + [copy_inputs(x) for _ in range(n - 1)], how.startswith("flush"), how

    def dense_rows(self, which: list[str]) -> list[dict]:
        try:
            return [self._dense_row(name) for name in which]
        finally:
            self._free()  # the copies and graphs of the rows are gone once their frames are

    def _dense_row(self, name: str) -> dict:
        traffic = dense_traffic(self.batch, self.shape.kv_heads, self.seq, self.shape.head_dim, self.itemsize)
        xs, flush, how = self._copies(self.base, traffic.kv)
        if name == "sdpa":
            backend_name, backend, expand = self.pick_sdpa()
            fns, kernel = [self._sdpa_step(x, backend, expand) for x in xs], f"torch-sdpa:{backend_name}"
        else:
            fns, kernel = [self._flashdecode_step(x) for x in xs], self.kernels["dense_decode"]
        t = time_steps(fns, self.device, flush=flush, l2=how)
        return self._row(name, "dense", kernel, t, None, traffic, {"method": name},
                         self._counts(traffic, self.shape.kv_heads, self.seq, 0, 0))

    def method_row(self, name: str, budget: float, options: dict) -> dict:
        try:
            cls = REGISTRY[name] if name in method_names() else None
            if cls is None:
                return self._method_row(get_method(name, budget=budget, **options))
            return self._method_row(cls.stand_in(budget, max(1, self.shape.layers), self.shape.kv_heads,
                                                 self.shape.head_dim, **options))
        finally:
            self.base.state = self.base.sel = None
            self._free()

    def _method_row(self, method) -> dict:
        x, pre = self.base, method.needs_pre_rope
        x.state = build_index(method, x, self.shape, self.seq)
        self._method_step(method, x)()  # one real step: the valid length is now seq
        select_bytes, source = select_read_bytes(method, x.state, x.q, x.q if pre else None)
        sel = method.select(x.state, x.q, x.q if pre else None)
        traffic = step_traffic(method, x.state, sel, x.q, self.batch, self.shape.kv_heads, self.shape.head_dim,
                               self.itemsize, select_bytes, source)
        counts = self._counts(traffic, sel.heads(self.shape.kv_heads), sel.n_selected, sel.sink, sel.window)
        del sel
        xs, flush, how = self._copies(x, traffic.kv)
        t = time_steps([self._method_step(method, c) for c in xs], self.device, flush=flush, l2=how)
        for c in xs:  # the selection each copy's step makes, for the attention-only timing
            c.state.length = self.seq
            c.sel = method.select(c.state, c.q, c.q if pre else None)
        attend = time_steps([self._attend_only(c) for c in xs], self.device, flush=flush, l2=how)
        return self._row(method.name, "sparse", self.kernels["sparse_decode"], t, attend, traffic, method.config(),
                         counts)

    def _row(self, name, kind, kernel, t: Timing, attend: Timing | None, traffic: Traffic, config: dict,
             counts: dict) -> dict:
        gbps = traffic.total / (t.us * 1e3)
        return {
            "seq": self.seq,
            "method": name,
            "kind": kind,
            "kernel": kernel,
            "us": t.us,
            "us_graph": t.graph_us,
            "us_eager": t.eager_us,
            "us_attend": attend.us if attend else None,
            "speedup": None,  # vs the best dense of the same seq: filled by run_bench
            "bytes_read": traffic.total,
            "bytes": traffic.to_dict(),
            "GBps": gbps,
            "pct_copy_bw": 100 * gbps / self.copy_gbps,
            "floor_us": floor_us(traffic.total, self.copy_gbps),
            **counts,
            "timing": t.to_dict(),
            "timing_attend": attend.to_dict() if attend else None,
            "method_config": config,
        }

    def _counts(self, traffic: Traffic, heads: int, selected: int, sink: int, window: int) -> dict:
        """Keys attended per selection head (mean over rows and heads) and that over the context."""
        attended = traffic.attended_total / (self.batch * heads)
        return {"selectivity": attended / self.seq, "attended": attended, "selected": selected, "sink": sink,
                "window": window, "selection_heads": heads}

    def _free(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
