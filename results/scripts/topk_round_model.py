"""CPU model of the fused top-k's two 5-way interval searches (kernels/topk.py: `_thresholds`, `_choose`) on 32-bit
keys: rounds of the bound's search over the 8192-score strided sample (J, J_HI as `_plan` sets them for 32 x 131072,
k 2048), and of the select's search over the candidates that bound passes, for row kinds from randn to rows with
1e30 outliers. Policies: "u" the committed fifths in key space, from the keys' [min, max]; "v" fifths in value space;
"adapt" value space while a round halves the keys in the interval, then key space; "v2" value space for two rounds.
"u1": the committed kernel's bound search, key space from [1, 2^32 - 1] (its select starts from [min, max]).

    python results/scripts/topk_round_model.py

Output of session 18 (mean and max over 6 rows each): results/topk-session18-h100.json["round_model"]."""
import numpy as np, math
def keys(x):
    b = x.astype(np.float32).view(np.int32).astype(np.int64)
    s = np.where(b<0, b ^ 0x7FFFFFFF, b)
    return s + (1<<31)
def val(u):
    s = np.int64(u) - (1<<31)
    b = s if s>=0 else s ^ 0x7FFFFFFF
    return np.array([b],dtype=np.int64).astype(np.int32).view(np.float32)[0]
def search(u, lo, hi, need, stop, policy):
    above=0; binc=int(((u>=lo)&(u<=hi)).sum()); hist=[]; vs = policy not in ("u", "u1"); rnd=0
    while lo<hi and above+binc>stop:
        q=max(((hi-lo+1)*858993459)>>32,1); top=hi+1
        ts=[min(lo+i*q,top) for i in (1,2,3,4)]
        if vs:
            lv, hv = float(val(lo)), float(val(hi))
            if np.isfinite(lv) and np.isfinite(hv) and hv>lv:
                tv=[lv+(hv-lv)*i/5 for i in (1,2,3,4)]
                tk=[int(keys(np.array([t],dtype=np.float32))[0]) for t in tv]
                # make thresholds valid: > lo, <= hi+1, nondecreasing
                prev=lo
                ts2=[]
                for t in tk:
                    t=max(t,prev+1 if not ts2 else prev); t=min(t,top); ts2.append(t); prev=t
                ts=ts2
        c=[int(((u>=t)&(u<=hi)).sum()) for t in ts]
        if c[3]>=need: lo,hi,n_in,n_up=ts[3],hi,c[3],0
        elif c[2]>=need: lo,hi,n_in,n_up=ts[2],ts[3]-1,c[2],c[3]
        elif c[1]>=need: lo,hi,n_in,n_up=ts[1],ts[2]-1,c[1],c[2]
        elif c[0]>=need: lo,hi,n_in,n_up=ts[0],ts[1]-1,c[0],c[1]
        else: lo,hi,n_in,n_up=lo,ts[0]-1,binc,c[0]
        above+=n_up; need-=n_up; nb=n_in-n_up
        rnd+=1
        if policy=="adapt" and nb*2>binc: vs=False
        if policy=="v2" and rnd>=2: vs=False
        binc=nb
        hist.append(binc)
    return lo,hist
rng=np.random.default_rng(0)
n=131072;k=2048;S=8192
D=[("randn",lambda: rng.standard_normal(n)),("exp",lambda: rng.exponential(size=n)),("unif",lambda: rng.random(n)),
   ("attn",lambda: rng.standard_normal(n)+ (rng.random(n)<0.01)*rng.standard_normal(n)*5),
   ("cauchy",lambda: rng.standard_cauchy(n)),("lognorm5",lambda: rng.lognormal(0,5,n)),
   ("outlier",lambda: np.where(rng.random(n)<1e-4, 1e30, rng.standard_normal(n))),
   ("neg",lambda: -rng.exponential(size=n)-100),("logits",lambda: rng.standard_normal(n)*3+30)]
for name,gen in D:
    out=[]
    for pol in ["u1","u","v","adapt","v2"]:
        rb=[];rs=[]
        for trial in range(6):
            x=gen().astype(np.float32)
            stride=n//(S//8); i=np.arange(S); pos=(i//8)*stride+(i%8)
            u=keys(x[pos])
            e=k*S/n; J=math.ceil(e+5*math.sqrt(e))+2; JHI=J+max(2,J//16)
            L,h=search(u,1 if pol=="u1" else int(u.min()),(1<<32)-1 if pol=="u1" else int(u.max()),J,JHI,pol)
            ua=keys(x); cand=ua[ua>=L]
            _,h2=search(cand,int(cand.min()),int(cand.max()),k,k,pol)
            rb.append(len(h)); rs.append(len(h2))
        out.append(f"{pol}: bound {np.mean(rb):.1f} (max {max(rb)}) sel {np.mean(rs):.1f} (max {max(rs)})")
    print(f"{name:9s}", " | ".join(out))
