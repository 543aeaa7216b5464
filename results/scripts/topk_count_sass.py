"""Session 22: SASS instruction counts (sm_90, compiled here without a GPU by this machine's Triton) of a kernel that
runs the bound's counting rounds over S keys held in registers, with `_count4` as it was until session 22 ("current":
0/1 flags shifted and or-ed into two 16-bit-packed words) against a select chain ("chain": each word is 0, 1 or
0x10001 by two nested selects; kernels/topk.py's `_count4` since session 23, which compiles to the same count). Whole-kernel counts (loads and the loop's scalar work included); the device's Triton (3.6)
may schedule differently.

    python results/scripts/topk_count_sass.py

Its printout: "count_sass" in results/topk-session22-cpu.json.
"""
import re
from collections import Counter

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import sparsekv.kernels.topk as T

@triton.jit
def _count4_flags(s, t1, t2, t3, t4, OFF: tl.constexpr):
    va = T._ge(s, t1, OFF) | (T._ge(s, t2, OFF) << 16)
    vb = T._ge(s, t3, OFF) | (T._ge(s, t4, OFF) << 16)
    ta, tb = tl.reduce((va, vb), 0, T._add2)
    return ta & 0xFFFF, ta >> 16, tb & 0xFFFF, tb >> 16

@triton.jit
def _count4_chain(s, t1, t2, t3, t4, OFF: tl.constexpr):
    a1 = (t1 - 1 - OFF).to(tl.int32)
    a2 = (t2 - 1 - OFF).to(tl.int32)
    a3 = (t3 - 1 - OFF).to(tl.int32)
    a4 = (t4 - 1 - OFF).to(tl.int32)
    va = tl.where(s > a2, 0x10001, tl.where(s > a1, 1, 0))
    vb = tl.where(s > a4, 0x10001, tl.where(s > a3, 1, 0))
    ta, tb = tl.reduce((va, vb), 0, T._add2)
    return ta & 0xFFFF, ta >> 16, tb & 0xFFFF, tb >> 16

@triton.jit
def kern(X, O, lo0, hi0, R, S: tl.constexpr, V: tl.constexpr):
    i = tl.arange(0, S)
    s = tl.load(X + i)
    lo = lo0.to(tl.int64)
    hi = hi0.to(tl.int64)
    acc = tl.zeros([], tl.int32)
    for r in range(R):
        t1, t2, t3, t4 = T._thresholds(lo, hi)
        if V == 0:
            n1, n2, n3, n4 = _count4_flags(s, t1, t2, t3, t4, 1 << 31)
        else:
            n1, n2, n3, n4 = _count4_chain(s, t1, t2, t3, t4, 1 << 31)
        acc += n1 + 3 * n2 + 5 * n3 + 7 * n4
        lo = t1 + (n1 & 1)  # data-dependent, so that the rounds stay a loop
        hi = t4 + (n4 & 1)
    tl.store(O, acc)

for S in (8192, 4096):
    for V in (0, 1):
        sig = dict(X="*i32", O="*i32", lo0="i64", hi0="i64", R="i32", S="constexpr", V="constexpr")
        ck = triton.compile(ASTSource(kern, sig, constexprs={(5,): S, (6,): V}), target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=8))
        sass = ck.asm["sass"]
        ins = [line.split("\t", 1)[1].strip() if "\t" in line else line.strip() for line in sass.splitlines()]
        ins = [x for x in ins if x and re.match(r'^[@A-Z]', x) and not x.endswith(':')]
        body = ins
        c = Counter(re.sub(r'^@!?U?P\w+\s+', '', x).split()[0].split('.')[0] for x in body)
        print(S, "chain" if V else "current", len(body), dict(c.most_common(12)))
