"""`run_bench`: validate the config, measure the copy bandwidth, time every method at every (seq, budget), and return
one JSON-ready dict (device, versions, config, bandwidth, floor, rows, top-k)."""

from __future__ import annotations

import datetime as _dt
import os
import platform
from contextlib import contextmanager
from typing import Callable, Iterable

import torch

from .. import validate
from ..errors import SparseKVError
from ..methods import REGISTRY, MethodOptions, method_names
from ..selection import BudgetSplit, check_budget, resolve_budget, split_budget
from .decode_step import DENSE_BASELINES, DecodeBench, kernel_backends
from .floor import copy_bandwidth, floor_us
from .shapes import Shape, from_name
from .topk import topk_rows

SCHEMA = 1
CPU_SEQ_CAP = 16384
SWEEP_SEQS = tuple(8192 << i for i in range(7))  # 8K ... 512K
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
PROTOCOL = ("one decode step of one layer on random K/V (torch.randn): write the new token's K/V into the "
            "preallocated cache, method.append it, method.select, sparse_decode over the selection; the context "
            "is `seq` keys including the new one. Query-aware selection at every step (Quest/MagicPIG/Adamas "
            "protocol). Dense baselines write the token and attend the whole cache. bytes_read counts K/V of the "
            "attended keys, the state select reads and the fp32 scores top-k writes and reads.")


def run_bench(shape: Shape | str, seq: int, methods: Iterable[str] | str, budget: float | Iterable[float],
              batch: int = 1, dtype: str | torch.dtype = "bf16", device: str = "auto",
              sweep: bool | Iterable[int] | None = None, *, options: MethodOptions | dict | None = None,
              require_gpu: bool = False, topk: bool = True, seed: int = 0,
              progress: Callable[[str], None] | None = None) -> dict:
    """Time one decode step of one layer for each method; see PROTOCOL. `methods`: registry names, plus `dense`
    (= the two dense baselines `sdpa` and `flashdecode`, which may also be named alone). `budget`: token count(s)
    or fraction(s) of the context, as `--budget`. `sweep`: True for 8K..512K (what fits in memory), or a list.
    `options` (MethodOptions, or a dict of its fields, e.g. {"sink": 128, "distance": "ip"}) go to the methods that
    take them; one that none of `methods` takes is an error."""
    say = progress or (lambda msg: None)
    shape = from_name(shape) if isinstance(shape, str) else shape
    dt = _dtype(dtype)
    dev, notes = _device(device, require_gpu)
    names = _methods(methods)
    budgets = [float(b) for b in ([budget] if isinstance(budget, (int, float)) else budget)]
    if not budgets and any(n not in DENSE_BASELINES for n in names):
        raise SparseKVError("give at least one --budget for the sparse methods")
    if batch <= 0 or seq <= 0:
        raise SparseKVError(f"--batch and --seq must be positive, got batch {batch}, seq {seq}")
    options = MethodOptions.of(options)
    options.check(names)
    itemsize = torch.empty((), dtype=dt).element_size()

    seqs = _seqs(seq, sweep, shape, batch, itemsize, dev, notes)
    cells = _cells(seqs, budgets, names, options, sweep is not None and sweep is not False, notes, shape)
    if topk and all(n in DENSE_BASELINES for n in names):
        notes.append("top-k not timed: it is timed at the sparse methods' budgets (k = budget minus sink and "
                     "window); add a sparse method, e.g. --method dense,oracle")

    with _kernels_env(dev) as kernels:
        if kernels["errors"]:
            notes.append(f"Triton kernels unavailable, torch reference timed instead: {kernels['errors']}")
        say("measuring copy bandwidth")
        bw = copy_bandwidth(dev)
        rows, topks, floors = [], [], []
        for L in seqs:
            say(f"seq {L}: random cache")
            bench = DecodeBench(shape, L, batch, dt, dev, bw["GBps"], kernels, seed)
            dense_bytes = shape.kv_bytes(L, batch, itemsize)
            floors.append({"seq": L, "dense_bytes": dense_bytes, "dense_floor_us": floor_us(dense_bytes, bw["GBps"])})
            dense = [n for n in names if n in DENSE_BASELINES]
            if dense:
                say(f"seq {L}: dense baselines ({', '.join(dense)})")
                rows += [dict(r, budget=None) for r in bench.dense_rows(dense)]
            for b, split in cells.get(L, []):
                for name in (n for n in names if n not in DENSE_BASELINES):
                    say(f"seq {L}: {name} at budget {b:g}")
                    rows.append(dict(bench.method_row(name, b, options.for_method(name)), budget=b))
                if topk:
                    k = split.k
                    if k > 0:
                        say(f"seq {L}: top-{k} of {L} x {batch * shape.q_heads} rows")
                        topks += [dict(r, seq=L, budget=b) for r in topk_rows(batch * shape.q_heads, L, k, dev,
                                                                               bw["GBps"], seed)]
            del bench
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        _speedups(rows)

    return {
        **result_header("sparsekv bench", SCHEMA, dev),
        "config": {"shape": shape.to_dict(), "seq": seqs, "requested_seq": seq, "methods": names,
                   "budgets": budgets, "batch": batch, "dtype": str(dt).replace("torch.", ""), "device": str(dev),
                   "sink": options.sink, "window": options.window, "pooling": options.pooling, "sweep": bool(sweep),
                   "seed": seed,
                   "cpu_fallback": dev.type != "cuda",
                   "cpu_seq_cap": CPU_SEQ_CAP if dev.type != "cuda" else None, "dense_layers": "n/a (one layer)"},
        "protocol": PROTOCOL,
        "timer": ("cuda-graph+cuda-events (headline; eager cuda-events beside it)" if dev.type == "cuda"
                  else "cpu-perf_counter"),
        "kernels": kernels,
        "copy_bandwidth": bw,
        "floor": floors,
        "rows": rows,
        "topk": topks,
        "notes": notes,
    }


def _dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise SparseKVError(f"unknown dtype {dtype!r}: use fp32, fp16 or bf16")
    return DTYPES[dtype]


def _device(device: str, require_gpu: bool) -> tuple[torch.device, list[str]]:
    has_gpu = torch.cuda.is_available()
    if require_gpu and not has_gpu:
        raise SparseKVError("--require-gpu: no CUDA device on this machine")
    if device == "auto":
        device = "cuda" if has_gpu else "cpu"
    if device.startswith("cuda") and not has_gpu:
        raise SparseKVError(f"--device {device}: no CUDA device on this machine")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise SparseKVError(f"unknown device {device!r}: use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and dev.index is not None:
        torch.cuda.set_device(dev)
    notes = []
    if dev.type != "cuda":
        notes.append(f"CPU run: no GPU timings; seq capped at {CPU_SEQ_CAP}; times are perf_counter medians")
    return dev, notes


def _methods(methods) -> list[str]:
    given = [m.strip() for m in (methods.split(",") if isinstance(methods, str) else methods) if m.strip()]
    if not given:
        raise SparseKVError("no methods given")
    known = method_names()
    out: list[str] = []
    for m in given:
        for name in (DENSE_BASELINES if m == "dense" else (m,)):
            if name not in DENSE_BASELINES and name not in known:
                avail = ["dense", *DENSE_BASELINES, *(k for k in known if k != "dense")]
                raise SparseKVError(f"unknown method {name!r}; available: {', '.join(avail)}")
            if name not in out:
                out.append(name)
    return out


def _need_bytes(shape: Shape, seq: int, batch: int, itemsize: int) -> int:
    """Device memory one seq needs: the cache, plus exact scoring's fp32 key copy and score rows, plus slack."""
    return (shape.kv_bytes(seq, batch, itemsize) + batch * shape.kv_heads * seq * shape.head_dim * 4
            + 4 * batch * shape.q_heads * seq * 4 + (512 << 20))


def _seqs(seq: int, sweep, shape: Shape, batch: int, itemsize: int, dev: torch.device, notes: list) -> list[int]:
    if sweep is True:
        seqs = list(SWEEP_SEQS)
    elif sweep:
        seqs = sorted({int(s) for s in sweep})
    else:
        seqs = [seq]
    if any(s < 2 for s in seqs):
        raise SparseKVError("seq must be at least 2 (the cache plus the new token)")
    if dev.type != "cuda":
        over = [s for s in seqs if s > CPU_SEQ_CAP]
        if over:
            notes.append(f"seq {', '.join(map(str, over))} {'is' if len(over) == 1 else 'are'} beyond the CPU cap: "
                         f"ran {CPU_SEQ_CAP} instead" if len(over) == len(seqs) or not sweep else
                         f"sweep stops at {CPU_SEQ_CAP} on the CPU (skipped {', '.join(map(str, over))})")
        return sorted({min(s, CPU_SEQ_CAP) for s in seqs})
    free, _ = torch.cuda.mem_get_info(dev)
    fits = [s for s in seqs if _need_bytes(shape, s, batch, itemsize) <= 0.9 * free]
    if not fits:
        need = _need_bytes(shape, min(seqs), batch, itemsize)
        raise SparseKVError(f"seq {min(seqs)} needs about {need / 2**30:.1f} GiB of GPU memory; "
                            f"{free / 2**30:.1f} GiB are free")
    if len(fits) < len(seqs):
        notes.append(f"stopped at seq {max(fits)}: seq {min(set(seqs) - set(fits))} would not fit in GPU memory")
        fits = [s for s in seqs if s <= max(fits)]
    return fits


def _cells(seqs: list[int], budgets: list[float], names: list[str], options: MethodOptions, sweep: bool,
           notes: list, shape: Shape) -> dict[int, list[tuple[float, BudgetSplit]]]:
    """Budgets to run at each seq, each with its split (top-k is timed at its k). A budget larger than the context
    is an error, except in a sweep, where that cell is skipped."""
    sparse = [n for n in names if n not in DENSE_BASELINES]
    for n in sparse:
        # rejects bad values and pooling up front (a method without its artifact: its untrained stand-in)
        options.build(n, budgets[0], (max(1, shape.layers), shape.kv_heads, shape.head_dim))
    cells: dict[int, list[tuple[float, BudgetSplit]]] = {}
    for L in seqs:
        for b in budgets:
            if sparse and sweep and resolve_budget(b, L) > L:
                notes.append(f"budget {b:g} skipped at seq {L} (larger than the context)")
                continue
            if sparse:
                check_budget(b, L)
            for n in sparse:  # each method's sink and window (given, else its paper's) within the budget
                validate.method_sink_window(n, options.sink, options.window, b, L)
            # the split without a method's defaults: sink and window as given (top-k's k = the rest)
            cells.setdefault(L, []).append((b, split_budget(b, options.sink or 0, options.window or 0, L)))
    return cells if sparse else {}


def _speedups(rows: list[dict]) -> None:
    """Speedup against the fastest dense baseline at the same seq, graph against graph where both were captured."""
    for L in {r["seq"] for r in rows}:
        dense = [r for r in rows if r["seq"] == L and r["kind"] == "dense"]
        if not dense:
            continue
        best_graph = min((r for r in dense if r["us_graph"] is not None), key=lambda r: r["us_graph"], default=None)
        best_eager = min(dense, key=lambda r: r["us_eager"])
        for r in rows:
            if r["seq"] != L:
                continue
            if best_graph is not None and r["us_graph"] is not None:
                r.update(speedup=best_graph["us_graph"] / r["us_graph"], speedup_vs=best_graph["method"],
                         speedup_basis="graph")
            else:
                r.update(speedup=best_eager["us_eager"] / r["us_eager"], speedup_vs=best_eager["method"],
                         speedup_basis="eager")


@contextmanager
def _kernels_env(dev: torch.device):
    """Which kernels run; when the Triton kernels fail to import on a GPU, force the torch path for the run."""
    kernels = kernel_backends(dev)
    old = os.environ.get("SPARSEKV_KERNELS")
    if kernels["errors"]:
        os.environ["SPARSEKV_KERNELS"] = "0"
        kernels = {**kernel_backends(dev), "errors": kernels["errors"]}
    try:
        yield kernels
    finally:
        if kernels["errors"]:
            if old is None:
                os.environ.pop("SPARSEKV_KERNELS", None)
            else:
                os.environ["SPARSEKV_KERNELS"] = old


def result_header(tool: str, schema: int, dev: torch.device) -> dict:
    """What every bench JSON starts with: schema, tool, time, device and versions."""
    return {"schema": schema, "tool": tool,
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "device": _device_info(dev), "versions": _versions()}


def _device_info(dev: torch.device) -> dict:
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        return {"type": "cuda", "name": p.name, "sms": p.multi_processor_count, "memory_bytes": p.total_memory,
                "l2_bytes": int(getattr(p, "L2_cache_size", 0)), "capability": f"{p.major}.{p.minor}",
                "cuda": torch.version.cuda}
    return {"type": "cpu", "name": platform.processor() or platform.machine(), "threads": torch.get_num_threads()}


def _versions() -> dict:
    import transformers

    import sparsekv

    out = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "sparsekv": getattr(sparsekv, "__version__", None)}
    try:
        import triton

        out["triton"] = triton.__version__
    except Exception:  # triton is a dependency, but a CPU wheel may lack it
        out["triton"] = None
    return out

