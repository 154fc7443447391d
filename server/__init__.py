"""The OpenAI-compatible HTTP server (`python serve.py`, the command at the top of the checkout).

app.py      the Starlette app (endpoints, request parsing, /metrics families), its argument parser and main
loop.py     the engine loop: one Lane (a RowBatch) per started policy, the Job each request shares with its
            handler, the Engine that owns the model
metrics.py  Prometheus text exposition: metric families and histograms
"""
