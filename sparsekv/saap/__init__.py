"""SAAP's offline index (`sparsekv index`: faiss spherical k-means of the keys + the query model, trained with the
paper's KL objective) and the pieces its decode method shares: the assignment functions (`model`) and the growing
inverted lists (`lists`). The method itself is sparsekv/methods/saap.py; the stage, sparsekv/saap/fit.py."""
