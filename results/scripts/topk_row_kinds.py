"""The row kinds of the top-k timing scripts: zero-centred, offset (logits, negative, scaled), uniform, exponential and
attention-like score rows."""
import torch

KINDS = ("randn", "logits", "neg", "scaled", "unif", "exp", "attn")


def gen(d, rows=32, n=131072, dev="cuda"):
    x = torch.randn(rows, n, device=dev)
    if d == "logits": return x * 3 + 30
    if d == "neg": return -100 - torch.empty_like(x).exponential_()
    if d == "scaled": return x * 0.05 + 4
    if d == "unif": return torch.rand_like(x)
    if d == "exp": return torch.empty_like(x).exponential_()
    if d == "attn": return x * 2 + 6 * (torch.rand_like(x) < 0.01).float()
    return x
