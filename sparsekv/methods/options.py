"""The method options of a run, declared once: every command that runs methods (eval, generate, bench, demo) builds
its flags from these fields, and a Python caller passes the same object (or a dict of its fields).

Each method takes the options its constructor names (`Method.option_names`) and checks their values itself; an
option that no method of the run takes is refused, not silently dropped. `artifact` may name several version
folders (comma-separated): each goes to the method its manifest was written for, so one run can compare methods
that each need their own (`--method adamas,spotlight --artifact ADAMAS,SPOTLIGHT`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from functools import cached_property
from pathlib import Path
from typing import Any

from ..errors import SparseKVError
from ..pooling import Pooling
from .base import REGISTRY, Method, get_method, method_names


def _option(help: str, flags: tuple[str, ...] = ()) -> Any:
    return field(default=None, metadata={"help": help, "flags": flags})


@dataclass(frozen=True)
class MethodOptions:
    """None: the method's own default."""

    sink: int | None = _option("sink tokens (default: the method's paper)")
    window: int | None = _option("recent-window tokens (default: the method's paper)")
    pooling: str | None = _option("GQA: 'group' (one choice per KV head) or 'head' (one per query head; default: the "
                                  "method's, 'head' for adamas as its authors' code, 'group' for the rest)")
    artifact: str | None = _option("an artifact version folder, or several comma-separated, each for the method it was "
                                   "written for: adamas (calibrate), spotlight (train-hash), saap (index)")
    hadamard: bool | None = _option("adamas ablation: Hadamard transform on/off", ("--hadamard/--no-hadamard",))
    bits: int | None = _option("adamas ablation: code bits 1, 2 or 3")
    distance: str | None = _option("adamas: code distance l1 (the paper) or l2, or ip: the query itself against the "
                                   "key codes' bucket centers")
    rerank: int | None = _option("adamas: the codes pick this many times the budget's keys and their exact q·k keeps "
                                 "the budget (1 = off)")
    page_size: int | None = _option("quest: tokens per page")
    nbits: int | None = _option("lsh: hash bits per key")
    head_top: int | None = _option("lsh, spotlight, adamas: each query head's M nearest keys are chosen first, the "
                                   "rest by the group's summed distance (pooling 'group'; default 0: off)")
    query_margin: float | None = _option("lsh, spotlight: ternary queries, a query bit counts only where its hash "
                                         "value exceeds this fraction of the query's root mean square over its bits "
                                         "(0: every bit, the papers' Hamming distance; default: spotlight its "
                                         "artifact's, 0.35 without one; lsh 0)")
    projection: str | None = _option("lsh: its hyperplanes, 'rotation' (angular LSH, the Spotlight paper's linear "
                                     "baseline; default) or 'gaussian' (plain SimHash hyperplanes, as MagicPIG)")
    probes: int | None = _option("saap: buckets visited per query, ℓ (default: the paper's 32 per 1024 buckets)")
    query_model: bool | None = _option("saap: rank buckets with the index's query model (the paper) or, with "
                                       "--no-query-model, by the query's inner product with the centroids (its "
                                       "k-means baseline)", ("--query-model/--no-query-model",))
    cap_keep: str | None = _option("saap: of the bucket the budget cuts, read its newest keys (default) or its "
                                   "oldest")
    centroid_share: float | None = _option("saap: the share of the visited buckets ranked by the query's inner "
                                           "product with the centroids, the rest by the query model, the best of "
                                           "each taken in turn (default 0: the query model's alone, the paper)")

    @classmethod
    def of(cls, options: "MethodOptions | dict | None") -> "MethodOptions":
        """A MethodOptions from itself, a dict of its fields, or None (every default)."""
        if isinstance(options, MethodOptions):
            return options
        given = dict(options or {})
        unknown = sorted(set(given) - {f.name for f in fields(cls)})
        if unknown:
            raise SparseKVError(f"unknown method option(s) {', '.join(unknown)}; available: "
                                f"{', '.join(f.name for f in fields(cls))}")
        return cls(**given)

    def given(self) -> dict:
        """The options set (not None), as the methods' constructors take them."""
        out = {k: v for k, v in asdict(self).items() if v is not None}
        if isinstance(out.get("artifact"), Path):
            out["artifact"] = str(out["artifact"])
        return out

    @cached_property
    def artifacts(self) -> dict[str, str]:
        """The artifact paths given, by the method each manifest names: read once per options object (at the first
        use: a bad path fails then), not once per method and budget."""
        from ..artifacts import artifact_paths, read_manifest

        by_method: dict[str, str] = {}
        for path in artifact_paths(self.artifact):
            method = str(read_manifest(path).get("method"))
            if method in by_method:
                raise SparseKVError(f"--artifact: {by_method[method]} and {path} were both written for {method}; "
                                    f"give one per method")
            by_method[method] = path
        return by_method

    def for_method(self, name: str) -> dict:
        """The options `name` takes (the artifact written for it, if one was given); bench's dense baselines (not
        registered methods) take none."""
        method_names()  # fills REGISTRY
        cls = REGISTRY.get(name)
        takes = cls.option_names() if cls is not None else frozenset()
        out = {k: v for k, v in self.given().items() if k in takes and k != "artifact"}
        if "artifact" in takes and self.artifact:
            path = self.artifacts.get(name)
            if path is not None:
                out["artifact"] = path
        return out

    def check(self, methods: list[str]) -> None:
        """An option that no method of the run takes is a mistake to report, and so is an artifact for a method
        the run does not have."""
        for method, path in self.artifacts.items():
            if method not in methods:
                raise SparseKVError(f"--artifact {path} was written for {method}; the methods of the run are "
                                    f"{', '.join(methods)}")
        used = set().union(*(self.for_method(m) for m in methods))
        unused = sorted(set(self.given()) - used)
        if unused:
            raise SparseKVError(f"option(s) {', '.join('--' + u.replace('_', '-') for u in unused)} apply to none of "
                                f"the methods {', '.join(methods)}")
        if self.given().get("head_top"):
            takers = [m for m in methods if "head_top" in self.for_method(m)]
            if all(REGISTRY[m].pooling_for(self.pooling) is not Pooling.GROUP for m in takers):
                # each query head already chooses its own keys: the option would be dropped without a word
                raise SparseKVError(f"--head-top applies with pooling 'group' (one choice per KV head); "
                                    f"{', '.join(takers)} choose per query head here: add --pooling group")

    @cached_property
    def _checked(self) -> set:
        """(method, budget) pairs whose option checks `check_build` has run on this options object."""
        return set()

    def check_build(self, name: str, budget: float | None) -> None:
        """Run `name`'s own option checks (bits, page size, ...) by building it at `budget`, once per options object:
        a grid's checks run more than once (before the model loads, then when it runs), and a build may read an
        artifact."""
        if (name, budget) not in self._checked:
            self.build(name, budget)
            self._checked.add((name, budget))

    def build(self, name: str, budget: float | None = None, stand_in: tuple[int, int, int] | None = None) -> Method:
        """The method `name` at `budget` (None: its own, for dense) with the options it takes. `stand_in`: (layers,
        KV heads, head dim) of a speed run, where a method that needs an artifact may run without one
        (Method.stand_in)."""
        if stand_in is not None and name in REGISTRY and budget is not None:
            return REGISTRY[name].stand_in(budget, *stand_in, **self.for_method(name))
        return get_method(name, **({} if budget is None else {"budget": budget}), **self.for_method(name))
