"""`dump`: run the model on text and record, per layer, the keys and a sample of the queries, pre- and post-RoPE.

Offline stages (calibrate, train-hash, index) fit on these instead of re-running the model. A dump is an artifact
(kind "activations", method "dump"): `manifest.json`, `positions.safetensors` (where each row came from) and one
`layer_NNN.safetensors` per layer, so a stage that shards layers reads only its own files.

Keys are recorded for every token, queries only at `queries_per_seq` seeded random positions per sequence: the
offline stages need all keys a query competes over, and the queries are what their losses average over. Each
sequence is one dense forward from position 0 through a SparseCache whose `recorder` sees the post-RoPE q/k of
every layer; pre-RoPE q/k are the same tensors rotated back with the model's own rotary tables (in fp32).

`dump_prompts` records eval's prompts (passkey, RULER) the same way, each followed by its teacher-forced reference
answer, with queries where the answer is produced instead of random ones, and the positions of the prompt tokens
that spell the answer (its evidence): `eval --task recall` on it measures a method's selection at the steps a task's
score depends on, and how much of the evidence's attention it reads.
"""

from __future__ import annotations

import gzip

import contextvars
import hashlib
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load_file

from . import artifacts
from .artifacts import ArtifactError, save_artifact
from .cache import SparseCache
from .errors import SparseKVError, one_line
from .progress import Ticker
from .methods import get_method
from .models import LoadedModel, cache_kwarg
from .patterns import FULL, AttentionPattern, model_patterns
from .rope import find_rotary, rope_tables, unrotate

KIND = "activations"
METHOD = "dump"
POSITIONS = "positions"
MIN_LAST_SEQ = 16  # a shorter tail has too few keys to be worth a forward
DATASET_ALIASES = {  # short names -> (hub id, config); datasets >= 3 runs no loading scripts, so parquet mirrors
    "pg19": ("emozilla/pg19", None),
    "wikitext": ("Salesforce/wikitext", "wikitext-103-raw-v1"),
}


def layer_stem(i: int) -> str:
    return f"layer_{i:03d}"


# -- reading -----------------------------------------------------------------------------------------------------

@dataclass
class Activations:
    """An opened dump. `layer(i)` loads one layer's file (sha256-checked the first time when `verify`):

    k_pre, k_post [Hkv, T, D]; q_pre, q_post [Hq, S, D] (stored dtype, fp16 by default);
    k_pos [T], q_pos [S] (int64, position within the sequence); k_seq [T], q_seq [S] (int64, sequence index).
    Rows are ordered by (sequence, position); sequence s holds keys `seq_offsets[s] : seq_offsets[s] + seq_lengths[s]`.
    """

    path: Path
    manifest: dict
    verify: bool = True
    _verified: set = field(default_factory=set, repr=False)
    _positions: dict | None = field(default=None, repr=False)

    @property
    def config(self) -> dict:
        return self.manifest["config"]

    @property
    def data(self) -> dict:
        return self.manifest["data"]

    @property
    def num_layers(self) -> int:
        return int(self.config["num_layers"])

    @property
    def kv_heads(self) -> int:
        return int(self.config["kv_heads"])

    @property
    def q_heads(self) -> int:
        return int(self.config["q_heads"])

    @property
    def head_dim(self) -> int:
        return int(self.config["head_dim"])

    @property
    def tokens(self) -> int:
        """T: keys recorded per layer and head (tokens actually run through the model)."""
        return int(self.data["tokens"])

    @property
    def queries(self) -> int:
        """S: queries recorded per layer and head."""
        return int(self.data["queries"])

    @property
    def seq_lengths(self) -> list[int]:
        return [int(n) for n in self.data["seq_lengths"]]

    @property
    def seq_offsets(self) -> list[int]:
        out, acc = [], 0
        for n in self.seq_lengths:
            out.append(acc)
            acc += n
        return out

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.config["dtype"])

    def patterns(self) -> list[AttentionPattern]:
        """Each layer's attention pattern as the model had it (dumps made before patterns were recorded: full
        attention at head_dim ** -0.5, which is what those models had: sparsekv ran no other)."""
        recorded = self.config.get("attention")
        if not recorded:
            return [FULL] * self.num_layers
        return [AttentionPattern(span=int(p.get("span") or 0), softcap=p.get("softcap"), scaling=p.get("scaling"),
                                 rope=p.get("rope")) for p in recorded]

    def positions(self) -> dict[str, torch.Tensor]:
        """k_pos, k_seq, q_pos, q_seq: the same for every layer (prompt dumps: also e_pos, e_seq)."""
        if self._positions is None:
            self._positions = self._load(POSITIONS)
        return self._positions

    def evidence(self) -> list[torch.Tensor] | None:
        """Prompt dumps: per sequence, the positions of the prompt tokens that spell its reference answer
        (`sparsekv.eval.evidence`); None for a dump of plain text, which has no answer."""
        pos = self.positions()
        if "e_pos" not in pos:
            return None
        return [pos["e_pos"][pos["e_seq"] == s] for s in range(len(self.seq_lengths))]

    def layer(self, i: int) -> dict[str, torch.Tensor]:
        if not isinstance(i, int) or not 0 <= i < self.num_layers:
            raise SparseKVError(f"layer {i} out of range: the dump at {self.path} has {self.num_layers} layers "
                                f"(0..{self.num_layers - 1})")
        return {**self._load(layer_stem(i)), **self.positions()}

    def check_files(self) -> "Activations":
        """Hash every file of the dump now (`verify`), so a corrupt layer stops an offline stage before its work,
        not when that layer is reached; one ArtifactError line names the file. A file is hashed once per process
        (the same path, size and modification time are not hashed again), and `layer(i)` does not hash it again."""
        if not self.verify:
            return self
        for fname, info in self.manifest["files"].items():
            key = _file_key(self.path, fname)
            if fname in self._verified or (key is not None and key in _HASHED):
                self._verified.add(fname)
                continue
            problem = artifacts._check_file(self.path, fname, info if isinstance(info, dict) else {}, True)
            if problem:
                raise ArtifactError(f"activations at {self.path} are corrupted: {problem}")
            self._verified.add(fname)
            if key is not None:
                _HASHED.add(key)
        return self

    def _load(self, stem: str) -> dict[str, torch.Tensor]:
        fname = stem + artifacts.SUFFIX
        info = self.manifest["files"].get(fname)
        if not isinstance(info, dict):
            raise ArtifactError(f"activations at {self.path} are incomplete: {fname} is not in its manifest")
        problem = artifacts._check_file(self.path, fname, info, self.verify and fname not in self._verified)
        if problem:
            raise ArtifactError(f"activations at {self.path} are corrupted: {problem}")
        try:
            out = load_file(str(self.path / fname))
        except Exception as e:
            raise ArtifactError(f"activations at {self.path} are corrupted: {fname} cannot be read "
                                f"({one_line(e)})") from None
        self._verified.add(fname)
        return out


_HASHED: set[tuple] = set()  # dump files whose sha256 this process checked: (path, name, size, mtime_ns)


def _file_key(path: Path, fname: str) -> tuple | None:
    try:
        st = (path / fname).lstat()
    except OSError:
        return None
    return (str(path.resolve()), fname, st.st_size, st.st_mtime_ns)


def load_activations(path: str | Path, lm: LoadedModel | None = None, *, verify: bool = True) -> Activations:
    """Open a dump folder. With `lm`, the dump must come from that model (same fingerprint: name, shapes, RoPE,
    weights hash); otherwise one line names what differs. Cheap: files are checked for presence and size here,
    and each is hashed (if `verify`) the first time it is loaded."""
    path = Path(path)
    manifest = artifacts.read_manifest(path)
    if manifest.get("kind") != KIND or manifest.get("method") != METHOD:
        raise ArtifactError(f"{path} is not an activations dump (kind {manifest.get('kind')!r}, "
                            f"method {manifest.get('method')!r}): make one with `sparsekv dump`")
    if lm is not None:
        check_fingerprint(path, manifest.get("model") or {}, lm.fingerprint())
    for fname, info in manifest["files"].items():
        problem = artifacts._check_file(path, fname, info if isinstance(info, dict) else {}, verify=False)
        size = path.joinpath(fname).stat().st_size if not problem else None
        if not problem and isinstance(info, dict) and size != info.get("bytes"):
            problem = f"{fname} has {size} bytes, expected {info.get('bytes')}"
        if problem:
            raise ArtifactError(f"activations at {path} are corrupted: {problem}")
    acts = Activations(path, manifest, verify=verify)
    missing = [s for s in [POSITIONS] + [layer_stem(i) for i in range(acts.num_layers)]
               if s + artifacts.SUFFIX not in manifest["files"]]
    if missing:
        raise ArtifactError(f"activations at {path} are incomplete: {', '.join(missing)} not in its manifest")
    return acts


def check_fingerprint(path: Path, recorded: dict, expected: dict) -> None:
    """One line naming every fingerprint field that differs between the dump and the current model."""
    diffs = [f"{k} {_short(recorded.get(k, '<missing>'))} != {_short(v)}"
             for k, v in expected.items() if recorded.get(k, "<missing>") != v]
    if diffs and all(d.startswith("weights_sha256 ") for d in diffs):  # the same name and shapes
        raise ArtifactError(f"activations at {path} were dumped from other weights (dump != current): {diffs[0]}; "
                            f"the same model loaded in fp16 hashes differently from bf16 or fp32, and the dump's "
                            f"model ran in {_dump_model_dtype(path)}")
    if diffs:
        raise ArtifactError(f"activations at {path} were dumped from another model (dump != current): "
                            + ", ".join(diffs))


def _dump_model_dtype(path: Path) -> str:
    """The dtype the dump's model ran in, from its report ("unknown" where it is not recorded)."""
    try:
        report = artifacts.read_manifest(path).get("report") or {}
    except ArtifactError:
        report = {}
    name = str(report.get("model_dtype", "unknown")).removeprefix("torch.")
    flag = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}.get(name)
    return f"{name} (--dtype {flag})" if flag else name


def _short(v: Any) -> str:
    s = str(v)
    return s[:12] + "…" if re.fullmatch(r"[0-9a-f]{16,}", s) else s


# -- writing -----------------------------------------------------------------------------------------------------

def split_sequences(n_tokens: int, seq_len: int) -> list[tuple[int, int]]:
    """(start, length) of each sequence: full `seq_len` chunks, plus the tail if it has >= 16 tokens."""
    out = [(s, min(seq_len, n_tokens - s)) for s in range(0, n_tokens, seq_len)]
    if out and out[-1][1] < min(seq_len, MIN_LAST_SEQ):
        out.pop()
    return out


def next_dump_dir(root: str | Path, lm: LoadedModel) -> Path:
    """`<root>/<model-slug>/dump/v<N+1>`: where a dump goes in the artifact store when no folder is named."""
    parent = Path(root) / artifacts.slugify(lm.name) / METHOD
    n = max((int(m.group(1)) for p in (parent.iterdir() if parent.is_dir() else [])
             if (m := re.fullmatch(r"v(\d+)", p.name))), default=0)
    return parent / f"v{n + 1}"


Progress = Callable[[int, int], Any]  # callback(tokens_done, tokens_total)


def check_seq_len(seq_len: int) -> None:
    """A dump's sequence length: fewer keys than MIN_LAST_SEQ give the offline stages nothing to pair."""
    if seq_len < MIN_LAST_SEQ:
        raise SparseKVError(f"--seq must be at least {MIN_LAST_SEQ} tokens, got {seq_len}")


@torch.no_grad()
def dump_activations(lm: LoadedModel, token_ids: list[int] | torch.Tensor, out_dir: str | Path, *,
                     seq_len: int = 2048, queries_per_seq: int = 256, seed: int = 0,
                     dtype: torch.dtype = torch.float16, source: str = "", progress: Any = None) -> Path:
    """Record keys (all tokens) and sampled queries of every layer and write them to `out_dir` (which must not
    exist; it appears atomically when complete). Returns `out_dir`.

    The whole dump is held in CPU memory until written: about
    `tokens * layers * 2 * (Hkv + Hq * queries_per_seq / seq_len) * D * bytes(dtype)` bytes.
    `progress`: a rich `Progress` (a task is added and advanced per sequence) or a callable(tokens_done, total).
    """
    ids = torch.as_tensor(token_ids, dtype=torch.long).flatten().cpu()
    check_seq_len(seq_len)
    if queries_per_seq < 1:
        raise SparseKVError(f"queries_per_seq must be positive, got {queries_per_seq}")
    if lm.max_context and seq_len > lm.max_context:
        raise SparseKVError(f"seq_len {seq_len} exceeds the model's context ({lm.max_context} tokens)")
    seqs = split_sequences(len(ids), seq_len)
    if not seqs:
        raise SparseKVError(f"need at least {min(seq_len, MIN_LAST_SEQ)} tokens to dump, got {len(ids)}")
    # Query positions: one seeded draw per sequence, sorted, so the dump is reproducible from (tokens, seed).
    gen = torch.Generator().manual_seed(seed)
    q_local = [torch.randperm(n, generator=gen)[: min(queries_per_seq, n)].sort().values for _, n in seqs]
    T = sum(n for _, n in seqs)
    config = {"seq_len": seq_len, "queries_per_seq": queries_per_seq, "seed": seed,
              "query_sampling": "uniform without replacement per sequence, torch.randperm seeded once"}
    data = {"source": source, "tokens_given": len(ids), "seq_len": seq_len, "queries_per_seq": queries_per_seq,
            "seed": seed, "tokens_sha256": hashlib.sha256(ids[:T].numpy().astype("<i8").tobytes()).hexdigest()}
    return _dump_sequences(lm, [ids[a : a + n] for a, n in seqs], q_local, out_dir, config, data, dtype, progress)


@torch.no_grad()
def dump_prompts(lm: LoadedModel, samples: list, out_dir: str | Path, *, queries_per_seq: int = 8,
                 dtype: torch.dtype = torch.float16, source: str = "", progress: Any = None,
                 seed: int | None = None) -> Path:
    """Record the activations of eval prompts (`sparsekv.eval.sample.Sample`s: passkey or RULER) where their answer
    is produced: each prompt with its reference answer appended (teacher-forced: " " + the references joined by
    ", ", at most the sample's max_new_tokens), keys of every token, queries at the last prompt token and the
    answer's tokens before its last (the positions that predict each answer token), the first `queries_per_seq`
    of them; the positions file also holds each prompt's evidence (`e_pos`, `e_seq`: the tokens that spell a
    reference, `sparsekv.eval.evidence`). `eval --task recall` on such a dump scores each method's selection where
    accuracy is decided.
    `seed`: the seed the prompts were made with, recorded as the dump's (no query is drawn at random; None when
    the prompts came from elsewhere).
    Writes `out_dir` as dump_activations does. Returns `out_dir`."""
    if queries_per_seq < 1:
        raise SparseKVError(f"queries_per_seq must be positive, got {queries_per_seq}")
    if not samples:
        raise SparseKVError("no prompts to dump")
    from .eval.evidence import evidence_positions

    seqs, q_local, evidence = [], [], []
    for s in samples:
        answer = lm.tokenizer(" " + ", ".join(s.references), add_special_tokens=False).input_ids[: s.max_new_tokens]
        ids = torch.tensor(list(s.ids) + answer, dtype=torch.long)
        if lm.max_context and len(ids) > lm.max_context:
            raise SparseKVError(f"a prompt and its answer take {len(ids)} tokens, more than {lm.name}'s context "
                                f"({lm.max_context} tokens)")
        first = len(s.ids) - 1
        seqs.append(ids)
        q_local.append(torch.arange(first, first + min(max(len(answer), 1), queries_per_seq)))
        evidence.append(torch.tensor(evidence_positions(lm.tokenizer, s.ids, s.references), dtype=torch.long))
    lengths = [len(i) for i in seqs]
    config = {"seq_len": max(lengths), "queries_per_seq": queries_per_seq, "seed": seed,
              "query_sampling": "answer positions: the last prompt token and the teacher-forced reference answer's "
                                "tokens before its last, the first queries_per_seq of them",
              "evidence": "e_pos/e_seq: the prompt tokens that spell a reference answer, every whole-word "
                          "occurrence (sparsekv.eval.evidence)"}
    data = {"source": source, "tokens_given": sum(lengths), "seq_len": max(lengths),
            "queries_per_seq": queries_per_seq, "seed": seed, "prompts": len(samples),
            "subtasks": sorted({s.subtask for s in samples if s.subtask}),
            "evidence_tokens": sum(len(e) for e in evidence), "evidence_prompts": sum(1 for e in evidence if len(e)),
            "tokens_sha256": hashlib.sha256(torch.cat(seqs).numpy().astype("<i8").tobytes()).hexdigest()}
    extra = {"e_pos": torch.cat(evidence),
             "e_seq": torch.cat([torch.full((len(e),), j, dtype=torch.long) for j, e in enumerate(evidence)])}
    return _dump_sequences(lm, seqs, q_local, out_dir, config, data, dtype, progress, extra)


def _dump_sequences(lm: LoadedModel, seqs: list[torch.Tensor], q_local: list[torch.Tensor], out_dir: str | Path,
                    config: dict, data: dict, dtype: torch.dtype, progress: Any,
                    extra_positions: dict[str, torch.Tensor] | None = None) -> Path:
    """One dense forward per sequence (token ids), recording keys of every token and queries at `q_local` (sorted
    positions per sequence); `config` and `data` gain the shapes, counts and patterns, and the dump is written.
    `extra_positions` join the positions file (prompt dumps: their evidence)."""
    out_dir = Path(out_dir)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise SparseKVError(f"dtype must be a torch floating-point dtype, got {dtype!r}")
    if out_dir.exists():
        raise SparseKVError(f"{out_dir} already exists; pick another output folder or delete it")
    patterns = model_patterns(lm.model)  # refuses a model sparsekv cannot run, before any work
    rotary = find_rotary(lm.model)
    if rotary is None:
        raise SparseKVError(f"model {lm.name!r} has no rotary_emb module: cannot recover pre-RoPE q/k")
    lengths = [len(ids) for ids in seqs]
    T, S = sum(lengths), sum(len(q) for q in q_local)
    L, Hkv, Hq, D = lm.num_layers, lm.kv_heads, lm.q_heads, lm.head_dim

    buf = [{"k_pre": torch.empty(Hkv, T, D, dtype=dtype), "k_post": torch.empty(Hkv, T, D, dtype=dtype),
            "q_pre": torch.empty(Hq, S, D, dtype=dtype), "q_post": torch.empty(Hq, S, D, dtype=dtype)}
           for _ in range(L)]
    pos = {"k_pos": torch.cat([torch.arange(n) for n in lengths]),
           "k_seq": torch.cat([torch.full((n,), s, dtype=torch.long) for s, n in enumerate(lengths)]),
           "q_pos": torch.cat(q_local),
           "q_seq": torch.cat([torch.full((len(q),), s, dtype=torch.long) for s, q in enumerate(q_local)]),
           **(extra_positions or {})}

    report = Ticker(progress, T, "dump")
    t0, k_off, q_off = time.perf_counter(), 0, 0
    for s, ids in enumerate(seqs):
        seen = _run_sequence(lm, rotary, patterns, ids, q_local[s], buf, k_off, q_off, dtype)
        if sorted(seen) != list(range(L)):
            raise SparseKVError(
                f"recorded layers {sorted(set(seen))} of {L}: the model does not run the sparsekv attention "
                f"function on every layer (load it with sparsekv.models.load_model)")
        k_off, q_off = k_off + len(ids), q_off + len(q_local[s])
        report.advance(len(ids))
    seconds = time.perf_counter() - t0

    config = {"dtype": str(dtype).removeprefix("torch."), **config, "min_last_seq": MIN_LAST_SEQ, "num_layers": L,
              "kv_heads": Hkv, "q_heads": Hq, "head_dim": D,
              "pre_rope": "post-RoPE q/k rotated back with the model's rotary tables in fp32",
              # what each layer may attend: offline stages and recall honour the same windows and scores
              "attention": [p.describe() for p in patterns]}
    data = {**data, "tokens": T, "sequences": len(seqs), "seq_lengths": lengths, "queries": S}
    tensors = {POSITIONS: pos, **{layer_stem(i): buf[i] for i in range(L)}}
    nbytes = sum(t.nbytes for named in tensors.values() for t in named.values())
    return _write(lm, out_dir, config, tensors, data, {"seconds": round(seconds, 3), "bytes": nbytes,
                                                       "model_dtype": str(next(lm.model.parameters()).dtype)})


def _run_sequence(lm: LoadedModel, rotary, patterns: list[AttentionPattern], ids: torch.Tensor, q_idx: torch.Tensor,
                  buf: list[dict], k_off: int, q_off: int, dtype: torch.dtype) -> list[int]:
    """One dense forward of one sequence; the recorder copies each layer's q/k into the buffers."""
    n, dev, seen = len(ids), lm.device, []
    q_dev = q_idx.to(dev)

    def record(layer, query, keys, values, cache):
        start = keys.shape[2] - query.shape[2]  # 0 here: the whole sequence is one forward
        k = keys[:1, :, start:].float()
        q = query[:1].float().index_select(2, q_dev - start)
        cos, sin = rope_tables(cache.rotary, q, q_dev.unsqueeze(0), cache.pattern(layer).rope)
        parts = {"k_post": k, "k_pre": cache.pre_rope(k, start, layer), "q_post": q, "q_pre": unrotate(q, cos, sin)}
        for key, t in parts.items():
            t = t[0].to(dtype)
            if not torch.isfinite(t).all():
                raise SparseKVError(f"layer {layer}: {key} overflows {str(dtype).removeprefix('torch.')} "
                                    f"(|x| up to {parts[key].abs().max().item():.3g}); dump with a wider dtype")
            rows = slice(k_off, k_off + k.shape[2]) if key[0] == "k" else slice(q_off, q_off + len(q_idx))
            buf[layer][key][:, rows] = t.cpu()
        seen.append(layer)

    cache = SparseCache(get_method("dense"), lm.num_layers, lm.q_heads, n, rotary=rotary, patterns=patterns)
    cache.recorder = record
    x = ids.view(1, -1).to(dev)
    pos = torch.arange(n, device=dev).unsqueeze(0)
    # A fresh context: the cache registers itself as the active one, and must not outlive this call there.
    contextvars.copy_context().run(lambda: lm.model(input_ids=x, **cache_kwarg(lm.model, cache), position_ids=pos,
                                                    use_cache=True, logits_to_keep=1))
    cache.recorder = None
    return seen


def _write(lm: LoadedModel, out_dir: Path, config: dict, tensors: dict, data: dict, report: dict) -> Path:
    """save_artifact into a hidden folder beside `out_dir`, then one rename: `out_dir` appears only when whole."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-dump-", dir=out_dir.parent))
    try:
        written = save_artifact(tmp, method=METHOD, model_fingerprint=lm.fingerprint(), config=config,
                                tensors=tensors, data=data, report=report, version="dump", kind=KIND)
        if out_dir.exists():  # rename would silently replace an empty folder
            raise SparseKVError(f"{out_dir} already exists; pick another output folder or delete it")
        written.rename(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir



# -- text ----------------------------------------------------------------------------------------------------------

def text_tokens(lm: LoadedModel, text_file: str | Path | None = None, dataset: str | None = None,
                tokens: int = 32768) -> list[int]:
    """The first `tokens` token ids of a text file or a dataset (streamed; e.g. "pg19", "wikitext", any hub id,
    "id:config"). No special tokens are added; dataset documents are joined with the EOS token."""
    if tokens < 1:
        raise SparseKVError(f"tokens must be positive, got {tokens}")
    if (text_file is None) == (dataset is None):
        raise SparseKVError("give exactly one of a text file or a dataset name")
    if text_file is not None:
        return _file_tokens(lm, Path(text_file), tokens)
    return _dataset_tokens(lm, dataset, tokens)


def _encode(lm: LoadedModel, text: str) -> list[int]:
    return list(lm.tokenizer.encode(text, add_special_tokens=False, verbose=False))


def _file_tokens(lm: LoadedModel, path: Path, want: int) -> list[int]:
    if not path.is_file():
        raise SparseKVError(f"text file not found: {path}")
    # Read a prefix that comfortably covers `want` tokens, growing it as needed: a corpus may be gigabytes.
    chars = max(want * 8, 1 << 16)
    while True:
        opener = gzip.open if path.suffix == ".gz" else open  # e.g. Debian's jargon-text ships jargon.txt.gz
        with opener(path, "rt", encoding="utf-8", errors="replace") as f:
            text = f.read(chars)
        whole = len(text) < chars
        ids = _encode(lm, text)
        # the cut may split a token, so a prefix must yield a margin beyond what is kept
        if whole or len(ids) > want + 64:
            break
        chars *= 2
    if len(ids) < want:
        raise SparseKVError(f"{path} has only {len(ids)} tokens; {want} asked")
    return ids[:want]


def _dataset_tokens(lm: LoadedModel, name: str, want: int) -> list[int]:
    try:
        import datasets
    except ImportError:
        raise SparseKVError("reading a dataset needs the `datasets` package: pip install 'sparsekv[data]'; "
                            "or pass a text file") from None
    hub_id, config = DATASET_ALIASES.get(name, (name.split(":")[0], name.split(":")[1] if ":" in name else None))
    eos = getattr(lm.tokenizer, "eos_token_id", None)
    ids: list[int] = []
    try:
        rows = datasets.load_dataset(hub_id, config, split="test", streaming=True)
        for row in rows:
            text = row.get("text") if isinstance(row.get("text"), str) else next(
                (v for v in row.values() if isinstance(v, str)), None)
            if not text:
                continue
            if ids and eos is not None:
                ids.append(int(eos))
            ids.extend(_encode(lm, text))
            if len(ids) >= want:
                return ids[:want]
    except SparseKVError:
        raise
    except Exception as e:
        raise SparseKVError(f"cannot read dataset {name!r} ({hub_id}, split test): "
                            f"{one_line(e, limit=300)}") from None
    raise SparseKVError(f"dataset {name!r} has only {len(ids)} tokens in its test split; {want} asked")
