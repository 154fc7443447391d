"""serve.py driven by the real `openai` client (the test extra pins it): a uvicorn server on a free 127.0.0.1 port,
on the tiny checkpoint and on the default model, with two started policies."""
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from cache import PolicyError
from runtime.steps import UsageError
import serve
from server.app import build_engine, build_parser
from tests.test_serve import PROMPTS, ROOT, SPECS, TWO, alone, running, wait_for


@contextlib.contextmanager
def served_openai(checkpoint, *flags):
    """running(...) with an openai client on it -> (openai client, httpx client, Engine)."""
    with running(checkpoint, *flags) as (http, srv):
        url = str(http.base_url).rstrip("/") + "/v1"
        with openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60) as client:
            yield client, http, srv


@pytest.fixture(scope="module")
def two(tiny_dir):
    flags = ["--policies", TWO, "--max-batch", "3", "--max-new-tokens-limit", "64", "--max-seq-length", "512"]
    with served_openai(tiny_dir, *flags) as s:
        yield s


def test_completions_and_chat_streamed_and_not(two):
    client, _, _ = two
    for name in SPECS:
        pick = {"extra_body": {"kv_policy": name}}
        done = client.completions.create(model="tiny", prompt="The capital of France is", max_tokens=8,
                                         temperature=0, **pick)
        [choice] = done.choices
        assert choice.finish_reason == "length" and done.usage.completion_tokens == 8 and choice.text
        assert done.model_extra["kv_policy"] == name
        chunks = list(client.completions.create(model="tiny", prompt="The capital of France is", max_tokens=8,
                                                temperature=0, stream=True, stream_options={"include_usage": True},
                                                **pick))
        assert "".join(c.choices[0].text for c in chunks[:-1]) == choice.text
        assert chunks[-2].choices[0].finish_reason == "length" and chunks[-1].usage == done.usage
        assert chunks[-1].choices == [] and all(c.usage is None for c in chunks[:-1])   # OpenAI's include_usage

        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
        chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0, **pick)
        assert chat.choices[0].message.role == "assistant" and chat.choices[0].finish_reason == "length"
        assert chat.model_extra["kv_policy"] == name and chat.usage.completion_tokens == 6
        parts = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                                    stream=True, **pick))
        assert "".join(p.choices[0].delta.content or "" for p in parts) == chat.choices[0].message.content
        assert parts[-1].choices[0].finish_reason == "length"


def test_seeded_sampling_is_the_same_alongside_others(two):
    """A seeded sampled request gives the same text alone and while other requests share its batch."""
    client, _, _ = two
    body = dict(model="tiny", prompt="Once upon a time", max_tokens=12, temperature=1.0, top_p=0.9, seed=7,
                extra_body={"top_k": 50})
    first = client.completions.create(**body).choices[0].text
    with ThreadPoolExecutor(2) as pool:
        others = [pool.submit(client.completions.create, model="tiny", prompt=p, max_tokens=n, temperature=0)
                  for p, n in list(PROMPTS.items())[:2]]
        again = client.completions.create(**body).choices[0].text
        assert all(f.result().choices[0].finish_reason for f in others)
    assert again == first
    assert client.completions.create(**{**body, "seed": 8}).choices[0].text != first


@pytest.mark.parametrize("create, kwargs, param", [
    ("completions", dict(prompt="hi", n=2), "n"),
    ("completions", dict(prompt="hi", n=2, stream=True), "n"),
    ("completions", dict(prompt="hi", extra_body={"kv_policy": "h2o"}), "kv_policy"),
    ("completions", dict(prompt="hi", max_tokens=65), "max_tokens"),
    ("completions", dict(prompt="hi " * 500, max_tokens=64), "prompt"),
    ("completions", dict(prompt="hi", temperature=2.5), "temperature"),
    ("completions", dict(prompt="hi", stop=["a", "b", "c", "d", "e"]), "stop"),
    ("completions", dict(prompt="hi", extra_body={"top_k": 0}), "top_k"),
    ("chat", dict(messages=[]), "messages"),
    ("chat", dict(messages=[{"role": "user", "content": "hi"}], model="gpt-4"), "model"),
])
def test_bad_input_is_a_400_the_client_reads(two, create, kwargs, param):
    client, http, _ = two
    endpoint = client.completions if create == "completions" else client.chat.completions
    with pytest.raises(openai.BadRequestError) as e:
        endpoint.create(**{"model": "tiny", "max_tokens": 4, **kwargs})
    assert e.value.status_code == 400 and e.value.param == param and e.value.type == "invalid_request_error"
    assert http.get("/health").json()["rows_in_use"] == 0


def test_a_disconnect_mid_stream_frees_the_row(tiny_dir):
    """A client that closes its stream frees its row in its policy's batch; the other policy is not held up."""
    flags = ["--policies", TWO, "--max-batch", "1", "--max-new-tokens-limit", "4000", "--max-seq-length", "4100"]
    with served_openai(tiny_dir, *flags) as (client, http, srv):
        stream = client.completions.create(model="tiny", prompt="Tell me everything", max_tokens=4000, temperature=0,
                                           stream=True, extra_body={"kv_policy": "snapkv"})
        next(iter(stream))                                      # it holds snapkv's only row
        assert http.get("/health").json()["policies"]["snapkv"]["rows_in_use"] == 1
        other = client.completions.create(model="tiny", prompt="Meanwhile", max_tokens=6, temperature=0)
        assert other.usage.completion_tokens == 6 and other.model_extra["kv_policy"] == "full"
        stream.close()
        wait_for(http, lambda h: h["policies"]["snapkv"]["rows_in_use"] == 0 and h["requests"].get("cancelled") == 1)
        again = client.completions.create(model="tiny", prompt="Hi", max_tokens=3, temperature=0,
                                          extra_body={"kv_policy": "snapkv"})
        assert again.usage.completion_tokens == 3
        assert srv.finished["snapkv", "cancelled"] == 1 and srv.finished["snapkv", "length"] == 1


def test_wait_policy_flag():
    assert serve.wait_policy_flag(["serve.py", "--checkpoint", "x"]) == "default"
    assert serve.wait_policy_flag(["serve.py", "--omp-wait-policy", "active"]) == "active"
    assert serve.wait_policy_flag(["serve.py", "--omp-wait-policy=inherit"]) == "inherit"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--checkpoint", "x", "--omp-wait-policy", "spin"])


def test_cli_stops_on_sigterm_after_the_requests_in_flight(tiny_dir):
    """The real command line with two policies: bad flags are one-line errors (exit 2); SIGTERM lets a streamed
    request in flight in each policy's batch finish, then the server exits 0."""
    # the torch twins of the C++ kernels: a server process must not wait on a kernel build (kernels/cpu.py)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "KVC_CPU_KERNELS": "0"}
    bad = subprocess.run([sys.executable, "serve.py", "--checkpoint", str(tiny_dir), "--max-batch", "0"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--max-batch must be at least 1" in bad.stderr
    for flags, message in ((["--tp", "2"], "serve.py does not support --tp"),
                           (["--prefill-batch", "0"], "--prefill-batch must be at least 1"),
                           (["--agnostic-max-question", "0"], "--agnostic-max-question must be at least 1"),
                           (["--policies", "full; nope"], "unknown policy 'nope'"),
                           (["--policies", "full; full:kv_bits=4"], "'full' is listed twice")):
        with pytest.raises((UsageError, PolicyError), match=message):
            build_engine(build_parser().parse_args(["--checkpoint", str(tiny_dir), *flags]))
    srv = build_engine(build_parser().parse_args(["--checkpoint", str(tiny_dir), "--policies", "snapkv",
                                                  "--agnostic-max-question", "7"]))
    assert srv.lanes["snapkv"].batch.max_question == 7                  # the flag reaches every lane's RowBatch
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "serve.py", "--checkpoint", str(tiny_dir), "--port", str(port),
                             "--policies", TWO], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout and proc.stdout.read()
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/health")
                if health.status_code == 200:
                    assert health.json()["omp_wait_policy"] == ""      # serve.py's default: OpenMP's own
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
        streams = [client.completions.create(model=os.path.basename(tiny_dir), prompt="Hi", max_tokens=200,
                                             temperature=0, stream=True, extra_body={"kv_policy": name})
                   for name in SPECS]
        chunks = [iter(s) for s in streams]
        for c in chunks:
            next(c)                                             # both are running
        proc.send_signal(signal.SIGTERM)                        # they still finish
        for c in chunks:
            rest = list(c)
            assert rest[-1].choices[0].finish_reason == "length" and rest[-1].usage is None
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_cli_exits_1_when_its_port_is_taken(tiny_dir):
    """uvicorn runs in a thread beside the engine loop (the main thread): a port it cannot bind ends the
    process with exit 1 and uvicorn's message, not a server that never answers."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "KVC_CPU_KERNELS": "0"}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        proc = subprocess.run([sys.executable, "serve.py", "--checkpoint", str(tiny_dir), "--port",
                               str(s.getsockname()[1])], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "address already in use" in proc.stderr


def test_default_model_greedy_alongside_others_equals_alone(default_dir, essay_text):
    """The default model, two policies (snapkv compressing a ~300-token document), eight chat requests at once
    (two questions on the same document: `full` keeps it and a row reads it in place): each greedy answer equals
    engine.generate's for the same request alone with the same policy."""
    specs = {"full": "full", "snapkv": "snapkv:budget=64"}
    flags = ["--policies", "; ".join(specs.values()), "--max-batch", "3", "--max-new-tokens-limit", "24",
             "--max-seq-length", "1024"]
    questions = {essay_text[:1200] + "\n\nSummarize the text above in one sentence.": 24,
                 essay_text[:1200] + "\n\nWhat is the text above about? Answer briefly.": 20,
                 "What is the capital of France?": 16, "Write a haiku about the sea.": 20}
    work = [(name, q, n) for name in specs for q, n in questions.items()]
    with served_openai(default_dir, *flags) as (client, _, srv):
        def ask(w):
            return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": w[1]}],
                                                  max_tokens=w[2], temperature=0, extra_body={"kv_policy": w[0]})
        ask(("full", essay_text[:1200] + "\n\nWho wrote it?", 4))   # seen: the next prompt on it keeps the essay
        with ThreadPoolExecutor(len(work)) as pool:
            got = list(pool.map(ask, work))
        assert srv.lanes["full"].batch.prefixes.stats()["hits"] >= 1      # a row read the kept essay in place
    for name, spec in specs.items():
        outs = [out for out, w in zip(got, work) if w[0] == name]
        for out, ref in zip(outs, alone(default_dir, flags, questions, spec, chat=True)):
            assert out.choices[0].message.content == ref.texts[0]
            assert out.usage.completion_tokens == len(ref.tokens[0]) and out.model_extra["kv_policy"] == name
