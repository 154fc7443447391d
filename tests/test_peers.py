"""scripts/peers.py: every side runs in a subprocess and a failing side is a row, never a crash of the run."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import peers  # noqa: E402


def test_worker_result_reports_crashes_and_errors():
    ok = subprocess.CompletedProcess([], 0, stdout='noise\n{"tok_s": 12.5}\n', stderr="")
    assert peers.worker_result(ok) == {"tok_s": 12.5}
    segv = subprocess.CompletedProcess([], -11, stdout="", stderr="")
    assert peers.worker_result(segv) == {"error": "crashed (SIGSEGV)"}
    fail = subprocess.CompletedProcess([], 1, stdout="", stderr="Traceback\nValueError: bad file\n")
    assert peers.worker_result(fail) == {"error": "exit status 1: ValueError: bad file"}


def test_parse_side():
    s = peers.parse_side("ours:ck.gguf:compile=1,policy=snapkv,policy_args=budget=256;window=8", Path("g"), Path("h"))
    assert s["kind"] == "ours" and s["opts"] == {"path": "ck.gguf", "compile": "1", "policy": "snapkv",
                                                 "policy_args": "budget=256;window=8"}
    assert peers.parse_side("llama.cpp", Path("g.gguf"), Path("h"))["opts"]["path"] == "g.gguf"
    assert peers.parse_side("ours:ck:qlinear_arith=avx2", Path("g"), Path("h"))["opts"]["qlinear_arith"] == "avx2"
    with pytest.raises(ValueError, match="unknown side"):
        peers.parse_side("vllm", Path("g"), Path("h"))
    with pytest.raises(ValueError, match="unknown side option 'compiled'"):
        peers.parse_side("ours:ck.gguf:compiled=1", Path("g"), Path("h"))


def test_missing_llama_cpp_names_the_install_command(tmp_path, monkeypatch):
    (tmp_path / "llama_cpp.py").write_text("raise ImportError('no llama_cpp')\n")   # shadows an installed one
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    res = peers.decode_tps(peers.parse_side("llama.cpp", tmp_path / "x.gguf", tmp_path), [1, 2, 3], steps=1,
                           threads=1, warmup=0, timeout=120)
    assert "llama-cpp-python is not installed" in res["error"] and "pip install -e '.[peers]'" in res["error"]


FAKE_LLAMA_SERVER = """#!{python}
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
open({log!r}, "w").write(json.dumps(args))

class H(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"{{}}")

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        out = {{"timings": {{"predicted_per_second": 40.0 + body["n_predict"], "prompt_ms": 10.0 * len(body["prompt"])}},
               "request": body}}
        self.send_response(200); self.end_headers(); self.wfile.write(json.dumps(out).encode())

HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def test_llama_server_side_runs_the_binary_and_reads_its_timings(tmp_path):
    """The llama-server side starts the given binary on the GGUF (one slot, the threads, a context for the prompt
    and the tokens) on a free 127.0.0.1 port, sends the prompt ids for warmup + steps tokens, and reports the
    server's own timings; a missing binary is a row naming --llama-server."""
    binary, log = tmp_path / "llama-server", tmp_path / "args.json"
    binary.write_text(FAKE_LLAMA_SERVER.format(python=sys.executable, log=str(log)))
    binary.chmod(0o755)
    side = peers.parse_side("llama-server", tmp_path / "m.gguf", tmp_path, binary)
    res = peers.decode_tps(side, [5, 6, 7], steps=3, threads=2, warmup=1, timeout=120)
    assert res["tok_s"] == 44.0 and res["prefill_s"] == 0.03 and res["peak_rss"] > 0, res
    args = json.loads(log.read_text())
    assert args[:2] == ["-m", str(tmp_path / "m.gguf")] and args[args.index("-t") + 1] == "2"
    assert args[args.index("-np") + 1] == "1" and args[args.index("-c") + 1] == str(3 + 3 + 1 + 8)
    assert args[args.index("--host") + 1] == "127.0.0.1"
    missing = peers.decode_tps(peers.parse_side("llama-server", tmp_path / "m.gguf", tmp_path, None), [1], steps=1,
                               threads=1, warmup=0, timeout=120)
    assert "--llama-server" in missing["error"]


def test_a_failing_side_is_a_row(tmp_path):
    res = peers.decode_tps(peers.parse_side(f"ours:{tmp_path / 'missing'}", tmp_path, tmp_path), [1, 2, 3],
                           steps=1, threads=1, warmup=0, timeout=300)
    assert "does not exist" in res["error"]


def test_prefill_row_runs_three_sides_and_prints_ratios(monkeypatch, capsys):
    """The benchmark's --prefill-row: our fp32 checkpoint, ours on the GGUF and llama.cpp on the same file, one
    context; prefill tok/s over our fp32 and over llama.cpp; a side that failed prints its error."""
    seen = {}

    def fake_run(args):
        seen.update(ours=args.ours, peers=args.peers, contexts=args.contexts, repeats=args.repeats)
        return [{"side": "ours fp32", "context": 2048, "prefill_s": 4.0},
                {"side": "ours gguf", "context": 2048, "prefill_s": 2.0},
                {"side": "llama.cpp", "context": 2048, "prefill_s": 8.0}]
    monkeypatch.setattr(peers, "run", fake_run)
    rows = peers.prefill_row(2, 2048, 3, gguf=Path("m.gguf"), hf=Path("ck"))
    assert seen == {"ours": ["ck", "m.gguf"], "peers": "llama.cpp", "contexts": [2048], "repeats": 3}
    assert [r["prefill_tok_s"] for r in rows] == [512.0, 1024.0, 256.0]
    out = capsys.readouterr().out
    assert "1024.0 (2.00x, 4.00x)" in out and "256.0 (0.50x, 1.00x)" in out
    assert "Q4_1 GGUF as stored: 4.00x llama.cpp's prefill, 2.00x our fp32's" in out
    monkeypatch.setattr(peers, "run", lambda args: [{"side": "ours fp32", "context": 64, "prefill_s": 1.0},
                                                    {"side": "ours gguf", "context": 64, "prefill_s": 1.0},
                                                    {"side": "llama.cpp", "context": 64, "error": "not installed"}])
    peers.prefill_row(1, 64)
    out = capsys.readouterr().out
    assert "error: not installed" in out and "Q4_1 GGUF as stored" not in out


@pytest.mark.model
@pytest.mark.parametrize("options", ["", ":kv_bits=4", ":qlinear_arith=int"])
def test_ours_on_the_default_model(default_gguf, options):
    side = peers.parse_side(f"ours:{default_gguf}{options}", default_gguf, default_gguf)
    res = peers.decode_tps(side, list(range(100, 140)), steps=2, threads=1, warmup=1, timeout=600)
    assert "error" not in res, res
    assert res["tok_s"] > 0 and res["peak_rss"] > 0 and res["prefill_s"] > 0
    assert 90 * 2**20 < res["model_rss"] < res["peak_rss"] - 150 * 2**20     # int4 weights; torch's own RSS is not counted
