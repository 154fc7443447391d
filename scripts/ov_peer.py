"""OpenVINO GenAI's side of `scripts/loadtest.py --offline`; runs in OpenVINO GenAI's own venv (the standard library
and openvino_genai only):

    DIR/ov/bin/python scripts/ov_peer.py SPEC.json      -> one JSON line: {"results": [per request], "wall_s"}

SPEC: prompts (text, the chat template already applied: GenerationConfig.apply_chat_template is off), max_tokens
(one per prompt), concurrency (requests in flight), warmup (the first prompts run once, untimed), threads
(INFERENCE_NUM_THREADS), max_batch (SchedulerConfig.max_num_seqs; its max_num_batched_tokens stays 256, the
prompt tokens of a step, as our --prefill-chunk), cache_gib (cache_size), eviction (null, or [start_size, recent_size, max_cache_size] of a
CacheEvictionConfig, NORM_SUM aggregation), model_dir (exported by `optimum-cli export openvino`).  The requests
go through its ContinuousBatchingPipeline (the scheduler LLMPipeline runs with a SchedulerConfig) one `step` at a
time, greedy, so each token's arrival is timed as the served sides' are.
"""
import json
import sys
import time

import openvino_genai as ov


def pipeline(spec: dict):
    sc = ov.SchedulerConfig()
    sc.cache_size = spec["cache_gib"]
    sc.max_num_seqs = spec["max_batch"]
    sc.enable_prefix_caching = True
    if spec.get("eviction"):
        start, recent, most = spec["eviction"]
        sc.use_cache_eviction = True
        sc.cache_eviction_config = ov.CacheEvictionConfig(start, recent, most, ov.AggregationMode.NORM_SUM)
    return ov.ContinuousBatchingPipeline(spec["model_dir"], sc, "CPU", {"INFERENCE_NUM_THREADS": spec["threads"]})


def config(max_new_tokens: int):
    c = ov.GenerationConfig()
    c.max_new_tokens = max_new_tokens
    c.do_sample = False
    c.apply_chat_template = False
    return c


def drive(pipe, prompts: list, max_tokens: list, concurrency: int) -> list:
    """Every prompt, at most `concurrency` in flight, one pipeline step at a time -> per request {ok, ttft,
    chunk_times, output_tokens}, times in seconds since it was added."""
    waiting, handles, sent = list(range(len(prompts))), {}, {}
    times = [[] for _ in prompts]
    out = [None] * len(prompts)
    while waiting or handles:
        while waiting and len(handles) < concurrency:
            i = waiting.pop(0)
            sent[i] = time.perf_counter()
            handles[i] = pipe.add_request(i, prompts[i], config(max_tokens[i]))
        pipe.step()
        for i, h in list(handles.items()):
            while h.can_read():
                for o in h.read().values():
                    times[i] += [time.perf_counter() - sent[i]] * len(o.generated_ids)
            status = h.get_status()
            if status != ov.GenerationStatus.RUNNING:
                ok = status == ov.GenerationStatus.FINISHED
                out[i] = {"ok": ok, "error": None if ok else str(status), "ttft": times[i][0] if times[i] else None,
                          "chunk_times": times[i], "output_tokens": len(times[i])}
                del handles[i]
    return out


def main(path: str) -> None:
    spec = json.loads(open(path).read())
    pipe = pipeline(spec)
    n = spec.get("warmup", 0)
    if n:
        drive(pipe, spec["prompts"][:n], spec["max_tokens"][:n], spec["concurrency"])
    t0 = time.perf_counter()
    results = drive(pipe, spec["prompts"], spec["max_tokens"], spec["concurrency"])
    print(json.dumps({"results": results, "wall_s": time.perf_counter() - t0}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
