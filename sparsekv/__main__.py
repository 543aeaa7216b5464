"""`python -m sparsekv ...`: the same CLI as the `sparsekv` console script."""

from .cli import main

main()
