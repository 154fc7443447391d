"""Double Sparsity (Yang et al., 2024), decode side: at every decode attention of every layer, approximate
scores = the query's heavy channels x the label cache (the keys' heavy channels, optionally 4-bit),
then x sinks + y recent tokens (the current one included) + the top-z middle tokens, N_c = x + y + z,
and exact attention over those N_c tokens.  Mechanics: label cache and heavy channels in cache/labels.py,
bias and attention in cache/sparse_read.py.  This is HShare's query-aware baseline with no sharing
(`hshare` with ratios 1-1-1 selects exactly the same tokens).

    python engine.py --checkpoint C --policy ds --policy-args preset=long,label_bits=4
    python engine.py --checkpoint C --policy snapkv+ds --policy-args budget=1024,preset=short
"""
from cache.labels import LabelReader


class DSPolicy(LabelReader):
    name = "ds"
