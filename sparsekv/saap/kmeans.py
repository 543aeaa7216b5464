"""The key partition: faiss spherical k-means per (layer, KV head) (§3 "From now on, we apply a spherical k-means
clustering with C = 1024 centroids"; Appendix A: "10 iterations with a random initialization", faiss' IVF k-means).

faiss-gpu is used where it is importable and sees a GPU, faiss-cpu otherwise: the same `faiss.Kmeans` API, and the
backend is recorded in the artifact. The keys are L2-normalised first (spherical k-means on the unit sphere: every
key weighs the same in its centroid; the assignment, an argmax of inner products with unit centroids, does not
depend on the norm anyway).

faiss warns when a centroid gets fewer than 39 training points; a dump too small for the asked C gets
C = keys // 39 instead, and the report says so.

faiss-cpu runs the heads side by side, one per CPU core, each on one OpenMP thread (faiss releases the GIL): one
head's k-means on all cores scales poorly (131072 keys x 64 dims, 1024 buckets, on 16 cores: 23.1 s for 16 heads one
after another, 14.0 s side by side; and on 2 cores 2 x 1 beat 1 x 2). Several OpenMP threads per side-by-side head
were far slower (4 x 4: 51.7 s). The result does not depend on it: the same centroids either way.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import torch

from ..errors import SparseKVError

MIN_POINTS = 39  # faiss' ClusteringParameters.min_points_per_centroid: below it faiss warns


def faiss_backend() -> tuple[object, str]:
    """(the faiss module, "faiss-gpu" | "faiss-cpu"); a clear error when neither is installed."""
    try:
        import faiss
    except ImportError as e:
        if e.name != "faiss":  # installed, but it or a library it loads is broken: say what failed
            raise SparseKVError(f"faiss is installed but does not import ({e}); reinstall faiss-cpu (or "
                                "faiss-gpu)") from None
        raise SparseKVError("sparsekv index needs faiss: pip install faiss-cpu (or faiss-gpu where its wheel "
                            "runs)") from None
    gpu = hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0
    return faiss, "faiss-gpu" if gpu else "faiss-cpu"


def clusters_for(asked: int, n_keys: int) -> tuple[int, str | None]:
    """(C to fit, a note when it is fewer than asked): at most n_keys // 39 so faiss has 39 points per centroid."""
    if asked < 1:
        raise SparseKVError(f"--clusters must be >= 1, got {asked}")
    most = n_keys // MIN_POINTS
    if most < 1:
        raise SparseKVError(f"{n_keys} training keys per head are too few for k-means (faiss wants {MIN_POINTS} per "
                            f"centroid): dump more tokens")
    if asked <= most:
        return asked, None
    return most, (f"clusters capped from {asked} to {most}: the dump has {n_keys} training keys per (layer, KV head) "
                  f"and faiss wants {MIN_POINTS} per centroid; dump more tokens for {asked}")


def spherical_kmeans(keys: torch.Tensor, clusters: int, iters: int = 10, seed: int = 0,
                     progress=None) -> tuple[torch.Tensor, str]:
    """keys [L, H, n, D] -> (unit centroids fp32 [L, H, C, D] on the CPU, backend). One faiss run per (layer, head),
    each seeded with `seed` (faiss draws its random initial centroids from it)."""
    faiss, backend = faiss_backend()
    L, H, n, D = keys.shape
    out = torch.empty(L, H, clusters, D)
    gpu = backend == "faiss-gpu"

    def one(li: int, h: int) -> None:
        if not gpu:
            faiss.omp_set_num_threads(1)  # this worker's own OpenMP setting: one core per head
        x = torch.nn.functional.normalize(keys[li, h].float(), dim=-1).cpu().contiguous().numpy()
        # faiss' defaults otherwise (it samples 256 keys per centroid from larger sets)
        km = faiss.Kmeans(D, clusters, niter=iters, spherical=True, seed=seed, verbose=False, gpu=gpu)
        km.train(x)
        out[li, h] = torch.from_numpy(km.centroids).float()

    heads = [(li, h) for li in range(L) for h in range(H)]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    workers = 1 if gpu else max(1, min(len(heads), cores))
    with ThreadPoolExecutor(workers) as pool:
        for done in [pool.submit(one, li, h) for li, h in heads]:
            done.result()  # in submission order: a worker's error surfaces here
            if progress is not None:
                progress(1)
    return torch.nn.functional.normalize(out, dim=-1), backend
