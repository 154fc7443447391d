"""Accuracy evaluations of KV-cache policies: `python -m eval.needle`, `python -m eval.perplexity`."""
