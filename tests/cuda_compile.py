"""Compile for a CUDA GPU, with no GPU, the Triton kernels an interpreted run launched.

The interpreter (TRITON_INTERPRET=1, how CI runs the kernels) executes a kernel's Python and never hands it to the
CUDA compiler, which refuses code the interpreter accepts (a loop-carried name of another type, say). `recording`
notes each launch's kernel, argument types and constexpr values; `compile_for_cuda` compiles those launches for
sm_90 in a subprocess without the interpreter, with the ptxas that Triton's wheel ships: the code path a GPU takes,
short of running it.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import subprocess
import sys

_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")


def can_compile() -> bool:
    """Whether this Triton has its NVIDIA backend with ptxas (what compile_for_cuda needs)."""
    try:
        import triton.backends.nvidia as nv
    except ImportError:
        return False
    return os.path.exists(os.path.join(os.path.dirname(nv.__file__), "bin", "ptxas"))


def _constexpr_value(v):
    v = getattr(v, "value", v)  # a tl.constexpr holds its value
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    raise TypeError(f"a constexpr of type {type(v).__name__}")


@contextlib.contextmanager
def recording(specs: dict):
    """Inside: every interpreted launch adds its spec to `specs` (one entry per distinct spec)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import mangle_type

    real = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        signature = inspect.signature(self.fn)
        bound = signature.bind(*args, **{k: v for k, v in kwargs.items() if k not in _OPTIONS})
        bound.apply_defaults()
        sig, consts = {}, {}
        for name, p in signature.parameters.items():
            v = bound.arguments[name]
            if "constexpr" in str(p.annotation) or v is None:
                consts[name] = _constexpr_value(v)
            else:
                sig[name] = mangle_type(v)
        spec = dict(module=self.fn.__module__, name=self.fn.__name__, sig=sig, consts=consts,
                    num_warps=kwargs.get("num_warps", 4))
        specs.setdefault(json.dumps(spec, sort_keys=True), spec)
        return real(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = run
    try:
        yield specs
    finally:
        InterpretedFunction.run = real


_COMPILE = r"""
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

errors = []
for s in json.load(sys.stdin):
    fn = getattr(importlib.import_module(s["module"]), s["name"])
    sig = {n: ("constexpr" if n in s["consts"] else s["sig"][n]) for n in fn.arg_names}
    src = ASTSource(fn, sig, {(fn.arg_names.index(n),): v for n, v in s["consts"].items()})
    try:
        triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": s["num_warps"]})
    except Exception as e:  # noqa: BLE001 - every failure is reported, with its innermost cause
        while e.__cause__ is not None:
            e = e.__cause__
        errors.append(f"{s['module']}.{s['name']} {s['consts']}: {type(e).__name__}: {str(e)[-2000:]}")
json.dump(errors, sys.stdout)
"""


def compile_for_cuda(specs) -> list[str]:
    """Compile each recorded launch for sm_90 (a fresh process: the interpreter off); the failures, one line each."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE], input=json.dumps(list(specs)), capture_output=True,
                          text=True, env=env, timeout=900)
    if done.returncode:
        raise RuntimeError(f"the compile process failed: {done.stderr[-3000:]}")
    return json.loads(done.stdout)
