"""The fused top-k kernel's PTX for sm_90, compiled on this machine without a GPU (Triton's own ptxas target), for 16
builds (fp32 / 16-bit keys x one or two tiles at a time x rows a whole number of chunks or not x the candidate window
or not): a hash of each kernel body without debug lines and labels, so that a refactor can be checked to compile to
the same code. Session 22: moving the streaming loops' tile loads, compares and stores into shared helpers left the
8 whole-chunk builds identical and changed only the order of independent instructions in the other 8.

    python results/scripts/topk_ptx_hashes.py [MODULE] > before.txt   # edit, then again > after.txt; diff them

The local Triton may not be the GPU machine's (3.9 here, 3.6 there): compare two runs on one machine. Session 22's
runs: "ptx_refactor" in results/topk-session22-cpu.json."""
import hashlib
import importlib
import inspect
import re
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

T = importlib.import_module(sys.argv[1] if len(sys.argv) > 1 else "sparsekv.kernels.topk")
names = list(inspect.signature(T._topk_kernel.fn).parameters)
for bits in (32, 16):
    for pairs in (False, True):
        for even in (True, False):
            for win in (0, 256):
                consts = dict(KEY_BITS=bits, NAN16=0 if bits == 32 else 0x7F80, CHUNK=32768, CAP=4096, S=8192,
                              PP=16 if win else 4, TILE=2048, HAS_BOUND=True, OFF=(1 << 31) if bits == 32 else 0,
                              UMAX=(1 << bits) - 1, MASKED=-2**31 if bits == 32 else 0,
                              FLIP=-2**31 if bits == 32 else 0, PAIR=True, EVEN=even, TRACE=False,
                              TILE_PAIRS=pairs, WIN=win)
                for name in ("CAP2", "RESTREAM"):  # session 23's paths for misjudged rows, off as before them
                    if name in names:
                        consts[name] = 0
                ptrs = dict(X=f"*i{bits}", OUT="*i64", TR="*i64", CK="*i32", CI="*i32", CNT="*i32", BOUND="*i32",
                            ARRIVE="*i32", DONE="*i32")
                sig = {n: "constexpr" if n in consts else ptrs.get(n, "i32") for n in names}
                ck = triton.compile(ASTSource(T._topk_kernel, sig, constexprs={(names.index(k),): v
                                                                                for k, v in consts.items()}),
                                    target=GPUTarget("cuda", 90, 32), options=dict(num_warps=8))
                body = re.search(r"\.visible \.entry.*?\n}", ck.asm["ptx"], re.S).group(0)
                body = "\n".join(line for line in body.splitlines()
                                 if line.strip() and not re.match(r"\s*(\.loc|\$L__tmp|//)", line))
                print(f"bits {bits} pairs {int(pairs)} even {int(even)} window {win}",
                      hashlib.md5(body.encode()).hexdigest()[:12], flush=True)
