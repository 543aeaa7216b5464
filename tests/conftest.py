import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if not torch.cuda.is_available():
    # Triton kernels run in the interpreter on the CPU (must be set before any kernel module is imported)
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny():
    """The in-memory random Llama: 2 layers, 6 query / 2 KV heads (GQA 3), head dim 20."""
    from sparsekv.models import load_model

    return load_model("tiny-random")


@pytest.fixture
def prompt_ids():
    return torch.randint(0, 256, (1, 200), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def one_thread():
    """Token-by-token decoding of a tiny model is all small ops: one thread is fastest (and immune to load)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def unimportable(monkeypatch):
    """unimportable(module, missing=module): `import module` (and its submodules) raises ModuleNotFoundError for
    `missing`, as when it is not installed (missing == module) or a library it loads is absent (another name)."""
    import builtins
    import sys

    real = builtins.__import__

    def hide(module: str, missing: str | None = None) -> None:
        missing = missing or module

        def fake(name, *args, **kwargs):
            if name == module or name.startswith(module + "."):
                raise ModuleNotFoundError(f"No module named {missing!r}", name=missing)
            return real(name, *args, **kwargs)

        monkeypatch.delitem(sys.modules, module, raising=False)
        monkeypatch.setattr(builtins, "__import__", fake)

    return hide
