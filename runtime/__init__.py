"""What runs a loaded model: the layer between the cache policies and the user's commands (engine.py, server/).

steps.py         prefill / decode steps, chunked prefill, compiled steps and warm-up, sampling (sample, Sampler),
                 UsageError and CacheFull
stats.py         GenerationResult and the generation statistics (throughput, KV bytes, peak memory)
context.py       a context compressed once, asked many questions (prefill_context, answer_questions)
rows.py          continuous batching: RowBatch (requests join and leave), Pending (a request being admitted)
prefix_cache.py  the LRU of prefilled prefixes RowBatch reuses (referenced while rows read them in place)
memory.py        admission by KV memory (--kv-memory): sizes, what a row of a policy costs, rows that fit
"""
