"""`sparsekv bench --e2e`: what users see, a whole model's decode speed per method at long context.

For each context length one random prompt is prefilled densely (timed; in chunks with `prefill_chunk`), then every
method decodes `new_tokens` tokens from that prefill with the same loop eval and generate use (`decode.generate`, or
for a batch `decode.generate_batch` with the prompt in every row: on a GPU the whole step replayed as a CUDA graph). The first tokens of each method compile its kernels and capture its graph and are not timed; the
timed generation is a second one. Reported per method: prefill seconds, decode ms per token and tokens per second,
the speedup over dense in the same run, peak GPU memory, the decode path, and the memory floor of a decode step: the
weights plus the K/V bytes dense reads per token, at the measured copy bandwidth.

A random-weight model of a named shape (`--shape`) decodes exactly the work a trained one does; its q/k weights are
scaled up so attention is peaky, as in `models.tiny_random`.
"""

from __future__ import annotations

import gc
import time
from typing import Callable, Iterable

import torch

from .. import validate
from ..errors import SparseKVError
from ..methods import MethodOptions, method_names
from ..models import LoadedModel, byte_tokenizer, load_model, wire
from ..selection import check_budget
from .floor import copy_bandwidth
from .run import _device, _dtype, result_header
from .shapes import Shape, from_name

SCHEMA = 2
PROTOCOL = ("end-to-end greedy decoding: one dense prefill of a random prompt per context length (timed), then per "
            "method and batch size (the prompt in every row) a warm-up generation (kernel compiles) and a timed one "
            "of new_tokens tokens from the same prefill; ms/token is the steady decode steps' wall time (each ends "
            "when its tokens reach the host; on a GPU the next step is queued before they are read), after the "
            "generation's first step, which captures its CUDA graph "
            "(first_step_s; generate_s is the whole call, loading the prefill included); tokens/s counts every "
            "row. Query-aware selection at every step. floor = (weights + the K/V dense reads of every row per "
            "step) / measured copy bandwidth.")


def random_model(shape: Shape, dtype: torch.dtype, device: torch.device, seed: int = 0) -> LoadedModel:
    """A random-weight Llama-architecture model of `shape` (its hidden, MLP and vocabulary sizes), built on `device`
    in `dtype`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if not shape.hidden:
        raise SparseKVError(f"shape {shape.name!r} has no model dimensions for an end-to-end run; use --model")
    tok = byte_tokenizer()
    cfg = LlamaConfig(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                      num_hidden_layers=shape.layers, num_attention_heads=shape.q_heads,
                      num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim, max_position_embeddings=1 << 20,
                      rope_theta=shape.rope_theta, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        old = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                model = LlamaForCausalLM(cfg)
        finally:
            torch.set_default_dtype(old)
        for layer in model.model.layers:  # peaky attention, so a selection's choice matters
            layer.self_attn.q_proj.weight.data.mul_(8)
            layer.self_attn.k_proj.weight.data.mul_(8)
    return wire(LoadedModel(model, tok, f"random-{shape.name}", "in-memory (random weights)"))


def run_e2e(seqs: Iterable[int], methods: Iterable[str] | str, budget: float, *, shape: Shape | str | None = None,
            model: str | None = None, batch: int | Iterable[int] = 1, new_tokens: int = 32, warmup_tokens: int = 4,
            dtype: str | torch.dtype = "bf16", device: str = "auto", options: MethodOptions | dict | None = None,
            require_gpu: bool = False, seed: int = 0, prefill_chunk: int | None = None,
            progress: Callable[[str], None] | None = None) -> dict:
    """Decode speed of a whole model per method and batch size (module docstring): one JSON-ready dict."""
    say = progress or (lambda msg: None)
    batches = [int(batch)] if isinstance(batch, int) else [int(b) for b in batch]
    if not batches or min(batches) < 1:
        raise SparseKVError(f"--batch must be positive, got {batches}")
    if prefill_chunk is not None and prefill_chunk < 1:
        raise SparseKVError(f"--prefill-chunk must be positive, got {prefill_chunk}")
    seqs = [int(s) for s in seqs]
    if not seqs or min(seqs) < 2:
        raise SparseKVError(f"--seq must be at least 2 tokens, got {seqs}")
    if new_tokens < 3 or warmup_tokens < 2:
        raise SparseKVError(f"--new-tokens must be at least 3, got {new_tokens}: the first token comes from the "
                            "prefill and the first step captures the graph, so only later steps are timed")
    names = [m.strip() for m in (methods.split(",") if isinstance(methods, str) else methods) if m.strip()]
    unknown = [n for n in names if n not in method_names()]
    if not names or unknown:
        raise SparseKVError(f"unknown method(s) {', '.join(unknown) or '(none given)'}; available: "
                            f"{', '.join(method_names())}")
    options = MethodOptions.of(options)
    options.check(names)
    if any(n != "dense" for n in names):  # as `bench` and `eval`: a budget over the context would time dense
        for seq in seqs:
            check_budget(budget, seq)
            for n in names:  # each method's sink and window within the budget, before the prefill
                validate.method_sink_window(n, options.sink, options.window, budget, seq)
    if shape is not None and model is not None:
        raise SparseKVError("give --shape or --model, not both")
    dt = _dtype(dtype)
    dev, _ = _device(device, require_gpu)
    notes = [] if dev.type == "cuda" else ["no GPU: CPU timings of the eager step, not what a GPU run measures"]

    say("measuring copy bandwidth")
    bw = copy_bandwidth(dev)
    say("building the model")
    if model is not None:
        lm = load_model(model, device=dev, dtype=dt, quiet=True)
    else:
        lm = random_model(from_name(shape or "llama3-8b") if not isinstance(shape, Shape) else shape, dt, dev, seed)
    weights = sum(p.numel() * p.element_size() for p in lm.model.parameters())
    itemsize = torch.empty((), dtype=dt).element_size()
    rows = []
    for seq in seqs:
        if lm.max_context and seq + new_tokens > lm.max_context:
            raise SparseKVError(f"--seq {seq} + {new_tokens} new tokens exceed {lm.name}'s context "
                                f"({lm.max_context} tokens)")
        kv = 2 * lm.num_layers * lm.kv_heads * lm.head_dim * itemsize * (seq + new_tokens // 2)
        floors = {b: (weights + b * kv) / (bw["GBps"] * 1e6) for b in batches}
        rows += _one_length(lm, seq, names, budget, options, new_tokens, warmup_tokens, seed, floors, prefill_chunk,
                            say)
    _speedups(rows)
    return {
        **result_header("sparsekv bench --e2e", SCHEMA, dev),
        "config": {"model": lm.name, "model_source": lm.source, "layers": lm.num_layers, "q_heads": lm.q_heads,
                   "kv_heads": lm.kv_heads, "head_dim": lm.head_dim, "weights_bytes": weights, "seq": seqs,
                   "methods": names, "budget": budget, "method_options": options.given(), "batch": batches,
                   "prefill_chunk": prefill_chunk, "new_tokens": new_tokens, "warmup_tokens": warmup_tokens, "dtype": str(dt).replace("torch.", ""),
                   "device": str(dev), "seed": seed},
        "protocol": PROTOCOL,
        "copy_bandwidth": bw,
        "rows": rows,
        "notes": notes,
    }


def _one_length(lm: LoadedModel, seq: int, names: list[str], budget: float, options: MethodOptions, new_tokens: int,
                warmup_tokens: int, seed: int, floors: dict[int, float], prefill_chunk: int | None,
                say) -> list[dict]:
    from ..decode import generate_batch, prefill

    dev = lm.device
    ids = torch.randint(3, len(lm.tokenizer) - 2, (1, seq), generator=torch.Generator().manual_seed(seed + seq))
    _reset_peak(dev)
    say(f"seq {seq}: dense prefill")
    t0 = _now(dev)
    pf = prefill(lm, ids, prefill_chunk, room=max(new_tokens, warmup_tokens))
    prefill_s = _now(dev) - t0
    prefill_peak = _peak_gb(dev)
    rows = []
    for batch, floor_ms in floors.items():
        for name in names:
            method_budget = None if name == "dense" else budget
            at = f"seq {seq}, batch {batch}: {name}"
            say(f"{at} (warm-up: compiles and graph capture)")
            shape = (lm.num_layers, lm.kv_heads, lm.head_dim)  # a method without its artifact: untrained stand-in
            generate_batch(lm, None, options.build(name, method_budget or 1.0, shape), warmup_tokens,
                           stop_on_eos=False, prefilled=[pf] * batch)
            gc.collect()
            _reset_peak(dev)
            say(f"{at}, {new_tokens} tokens")
            method = options.build(name, method_budget or 1.0, shape)
            t0 = _now(dev)
            g = generate_batch(lm, None, method, new_tokens, stop_on_eos=False, prefilled=[pf] * batch)[0]
            seconds = _now(dev) - t0
            ms = g.timing["steady_ms_per_step"]
            rows.append({"seq": seq, "batch": batch, "method": name, "budget": method_budget,
                         "method_config": method.config(), "prefill_s": round(prefill_s, 4),
                         "prefill_peak_gb": prefill_peak, "ms_per_token": round(ms, 4),
                         "tokens_per_s": round(batch * 1e3 / ms, 2), "steps": g.timing["steady_steps"],
                         "first_step_s": round(g.timing["first_step_s"], 4), "generate_s": round(seconds, 4),
                         "floor_ms": float(f"{floor_ms:.4g}"),  # significant digits: a tiny model's floor is < 1 µs
                         "of_floor": round(floor_ms / ms, 4),
                         "peak_gb": _peak_gb(dev), "selectivity": g.stats.get("selectivity"),
                         "decode_path": g.stats.get("decode_path")})
            gc.collect()
    del pf
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def _speedups(rows: list[dict]) -> None:
    dense = {(r["seq"], r["batch"]): r["ms_per_token"] for r in rows if r["method"] == "dense"}
    for r in rows:
        d = dense.get((r["seq"], r["batch"]))
        r["speedup_vs_dense"] = round(d / r["ms_per_token"], 4) if d else None


def _now(dev: torch.device) -> float:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return time.perf_counter()


def _reset_peak(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)


def _peak_gb(dev: torch.device) -> float | None:
    return round(torch.cuda.max_memory_allocated(dev) / 2**30, 2) if dev.type == "cuda" else None
