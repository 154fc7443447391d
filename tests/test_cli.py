"""engine.py's command line: the real model end to end, and a clear message plus a non-zero
exit (never a traceback) for every kind of bad input."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

import engine
from runtime.steps import UsageError

ROOT = Path(__file__).resolve().parent.parent


def run_main(capsys, *argv):
    """engine.main in-process -> (exit code, stdout, stderr)."""
    try:
        code = engine.main([str(a) for a in argv])
    except SystemExit as e:  # argparse errors
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_chat_answers_paris(default_dir):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # the test process's own OpenMP threads may spin
    p = subprocess.run([sys.executable, str(ROOT / "engine.py"), "--checkpoint", str(default_dir), "--chat",
                        "--prompt", "What is the capital of France?", "--max-new-tokens", "24"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "Paris" in p.stdout
    assert "decode" in p.stderr and "tok/s" in p.stderr and "KV cache" in p.stderr


def test_cli_bad_input_is_one_line_not_a_traceback(tmp_path):
    p = subprocess.run([sys.executable, str(ROOT / "engine.py"), "--checkpoint", str(tmp_path / "nope"),
                        "--prompt", "hi"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 2
    assert "Traceback" not in p.stderr and "does not exist" in p.stderr


def test_spec_and_policy_args_spellings_give_the_same_output(capsys, default_dir, essay_text):
    prompt = essay_text[:1500]
    outs = []
    for argv in (["--policy", "snapkv:budget=128"], ["--policy", "snapkv", "--policy-args", "budget=128"]):
        code, out, err = run_main(capsys, "--checkpoint", default_dir, "--prompt", prompt, "--max-new-tokens", "12",
                                  *argv)
        assert code == 0, err
        outs.append(out)
    assert outs[0] == outs[1] and outs[0].strip()


def test_batch_of_prompts_and_stats(capsys, default_dir):
    code, out, err = run_main(capsys, "--checkpoint", default_dir, "--prompt", "Hello", "--prompt", "The sky is",
                              "--max-new-tokens", "4")
    assert code == 0 and out.count("--- [") == 2
    assert "prompt tokens [1, 3]" in err


@pytest.mark.parametrize("argv, message", [
    (["--checkpoint", "{tmp}/missing", "--prompt", "hi"], "does not exist"),
    (["--checkpoint", "{tmp}/truncated.gguf", "--prompt", "hi"], "truncated or corrupt"),
    (["--checkpoint", "{tmp}/noconfig", "--prompt", "hi"], "no config.json"),
    (["--checkpoint", "{tmp}/badconfig", "--prompt", "hi"], "missing required field.*hidden_size"),
    (["--checkpoint", "{dir}", "--prompt", "hi", "--policy", "magic"], "unknown policy 'magic'; available: d2o, ds, full, h2o, hshare"),
    (["--checkpoint", "{dir}", "--prompt", "hi", "--policy-args", "budget"], "malformed policy argument 'budget'"),
    (["--checkpoint", "{dir}", "--prompt", "hi", "--policy", "snapkv:"], "malformed policy spec 'snapkv:'"),
    (["--checkpoint", "{dir}", "--prompt", "hi", "--policy", "snapkv:window=16"], "'window' is now 'obs_window'"),
    (["--checkpoint", "{dir}", "--prompt", "hi", "--policy", "snapkv:budget=64", "--policy-args", "budget=32"],
     "budget given twice"),
    (["--checkpoint", "{dir}", "--prompt", "hi", "--policy-args", "budget=64"], "has no parameter.*budget"),
    (["--checkpoint", "{dir}", "--prompt", "hi", "--max-new-tokens", "9000"], "exceeds the model's context length 8192"),
    (["--checkpoint", "{dir}", "--prompt", "hello there", "--max-new-tokens", "16", "--max-seq-length", "10"],
     "exceeds --max-seq-length 10"),
    (["--checkpoint", "{dir}", "--prompt", "hi", "--max-seq-length", "10000"], "exceeds the model's context length"),
    (["--checkpoint", "{dir}", "--prompt", "   "], "empty prompt"),
    (["--checkpoint", "{dir}", "--prompt-file", "{tmp}/empty.txt"], "empty prompt"),
    (["--checkpoint", "{dir}", "--prompt-file", "{tmp}/missing.txt"], "cannot read --prompt-file"),
    (["--checkpoint", "{dir}"], "give a prompt"),
    (["--checkpoint", "{dir}", "--prompt", "a", "--prompt", "b", "--batch-size", "3"], "does not match the 2 prompts"),
    (["--checkpoint", "{dir}", "--prompt", "hi", "--device", "cuda"], "no CUDA GPU"),
    (["--checkpoint", "{dir}", "--prompt", "hi", "--device", "tpu"], "unsupported device"),
    (["--checkpoint", "{dir}", "--prompt", "hi", "--dtype", "float64"], "invalid choice: 'float64'"),
    (["--checkpoint", "{dir}", "--prompt", "hi", "--kv-bits", "4", "--kv-group-size", "48",
      "--kv-residual", "96"], "head_dim 64 is not a multiple of --kv-group-size 48"),
    (["--checkpoint", "{dir}", "--prompt", "hi", "--kv-bits", "4", "--kv-residual", "40"],
     "--kv-residual 40 must be a positive multiple of --kv-group-size 32"),
    (["--checkpoint", "{dir}", "--prompt", "hi", "--kv-bits", "4", "--policy", "pod"], "has no KIVI storage"),
    (["--checkpoint", "{dir}", "--prompt", "hi", "--max-new-tokens", "0"], "at least 1"),
    (["--checkpoint", "{dir}", "--prompt", "hi", "--temperature", "-1"], r"--temperature must be >= 0"),
    (["--checkpoint", "{dir}", "--prompt", "hi", "--temperature", "nan"], r"--temperature must be >= 0"),
    (["--checkpoint", "{dir}", "--prompt", "hi", "--top-p", "1.5"], r"--top-p must be in \(0, 1\]"),
    (["--checkpoint", "{dir}", "--prompt", "hi", "--top-p", "0"], r"--top-p must be in \(0, 1\]"),
    (["--checkpoint", "{dir}", "--prompt", "hi", "--top-k", "0"], "--top-k must be >= 1"),
    (["--checkpoint", "{dir}", "--prompt", "hi", "--compile-prefill"], "--compile-prefill needs --compile"),
])
def test_bad_input_clear_message(capsys, tmp_path, default_dir, default_gguf, argv, message):
    import re
    if "--device" in argv and "cuda" in argv:
        import torch
        if torch.cuda.is_available():
            pytest.skip("a GPU is present")
    (tmp_path / "truncated.gguf").write_bytes(default_gguf.read_bytes()[:1_000_000])
    (tmp_path / "noconfig").mkdir()
    (tmp_path / "badconfig").mkdir()
    (tmp_path / "badconfig" / "config.json").write_text('{"vocab_size": 10, "num_hidden_layers": 1}')
    (tmp_path / "empty.txt").write_text("\n")
    argv = [a.format(tmp=tmp_path, dir=default_dir) for a in argv]
    code, out, err = run_main(capsys, *argv)
    assert code == 2
    assert re.search(message, err), err
    assert "Traceback" not in err


def test_kv_bits_32_on_a_float32_model_is_the_policy_as_it_is():
    """--kv-bits 32 names float32 storage: on a float32 model every policy keeps its own storage (it is
    not turned into a float32 copy of `full`); --kv-dtype bfloat16 is for `full` only."""
    from cache import make_policy
    args = engine.build_parser().parse_args(["--checkpoint", "x", "--kv-bits", "32", "--device", "cpu"])
    policy = make_policy("hshare")
    assert engine.kv_policy(policy, args) is policy
    args = engine.build_parser().parse_args(["--checkpoint", "x", "--kv-dtype", "bfloat16", "--device", "cpu"])
    assert engine.kv_policy(make_policy("full"), args).describe()["kv_dtype"] == "bfloat16"
    with pytest.raises(UsageError, match="only `full`"):
        engine.kv_policy(make_policy("snapkv"), args)


def test_one_sequence_is_printed_as_it_is_generated(capsys, tiny_dir):
    """A single prompt's text is written piece by piece while it is generated, and stdout is still generate's
    text and a newline; a batch keeps its `--- [i]` blocks."""
    code, out, err = run_main(capsys, "--checkpoint", tiny_dir, "--prompt", "Hello", "--max-new-tokens", "12")
    model, tokenizer = engine.load_model(tiny_dir, "cpu")
    ref = engine.generate(model, tokenizer, ["Hello"], 12)
    assert code == 0 and out == ref.texts[0] + "\n" and "decode" in err

    class Pieces(list):
        def write(self, text):
            self.append((text, len(seen)))             # the text and how many steps had been sampled then

        def flush(self):
            pass
    seen, pieces = [], Pieces()
    on_token, stream = engine.stream_printer(tokenizer, pieces)
    result = engine.generate(model, tokenizer, ["Hello"], 12,
                             on_token=lambda tokens: (seen.append(int(tokens[0])), on_token(tokens)))
    assert result.texts == ref.texts and seen[:len(ref.tokens[0])] == ref.tokens[0]
    assert [n for _, n in pieces] == list(range(1, len(pieces) + 1))        # one write per step, as sampled
    assert "".join(t for t, _ in pieces) + stream.flush() == ref.texts[0]
    code, out, _ = run_main(capsys, "--checkpoint", tiny_dir, "--prompt", "Hello", "--prompt", "Hi",
                            "--max-new-tokens", "3")
    assert code == 0 and out.startswith("--- [0]\n") and out.count("--- [") == 2


def test_interactive_chat_over_stdin(capsys, tiny_dir):
    """--interactive reads user turns from stdin and answers each with the whole conversation so far: each
    answer is generate's on the chat template of the turns before it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, str(ROOT / "engine.py"), "--checkpoint", str(tiny_dir), "--interactive",
                        "--max-new-tokens", "6"], input="Hi\n\nAnd then?\n", capture_output=True, text=True,
                       env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    assert p.stderr.count("> ") == 4                    # before each line read, and before the end of input
    model, tokenizer = engine.load_model(tiny_dir, "cpu")

    def answer(messages):
        ids = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
        return engine.generate(model, tokenizer, [ids], 6).texts[0]
    first = answer([{"role": "user", "content": "Hi"}])
    second = answer([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": first},
                     {"role": "user", "content": "And then?"}])
    assert p.stdout == first + "\n" + second + "\n"
    code, _, err = run_main(capsys, "--checkpoint", tiny_dir, "--interactive", "--prompt", "hi")
    assert code == 2 and "--interactive reads its prompts from the terminal" in err
