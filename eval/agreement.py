"""Agreement with the full cache: how soon and how often a policy's greedy tokens differ.

    python -m eval.agreement --policy snapkv --policy-args budget=256 --context-length 2048 --new-tokens 64
    python -m eval.agreement --proximal 64,128,256,512,1024 --context-length 2048   # POD Figure 1(c)

Generation agreement (any --policy): each sample is a window of the text (Paul Graham's essays,
or --text FILE) of --context-length tokens; the full cache continues it greedily for
--new-tokens tokens (the reference).  The policy then prefills the same window and is
teacher-forced along the reference one decode step at a time (decode-time eviction acts), and
at every step its greedy choice is compared with the reference token:
  first_divergence   index of the first generated token where the policy's greedy choice
                     differs: its own free-running greedy output equals the reference up to
                     there (= --new-tokens when it never differs)
  token_agreement    share of the steps where the choices agree, each step conditioned on the
                     reference prefix (so one early miss does not count every later token)

Proximal agreement (--proximal N1,N2,...; the statistic of POD's Figure 1(c)): for the last
--last positions of each window, the share where the next-token prediction of the model with
every token attending only to its proximal tokens (the first --n-sink tokens and the most
recent N - n_sink, itself included; in every layer and at every position) equals the
prediction with full attention.  The proximal model is one forward pass with that band mask
(`ProximalCache`): exactly what a streaming cache of budget N gives when it is teacher-forced.
"""
from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "ACTIVE")

from typing import Callable, Optional, Sequence  # noqa: E402

import torch  # noqa: E402

from eval import common, measure  # noqa: E402
from eval.common import UsageError  # noqa: E402
from eval.perplexity import text_windows  # noqa: E402
from cache.full import FullCache  # noqa: E402
from runtime.steps import run_decode, run_prefill  # noqa: E402


# --------------------------------------------------------------------------- generation agreement

def reference(loaded: common.Loaded, ids: list[int], new_tokens: int) -> list[int]:
    """The full cache's greedy continuation of `ids`: exactly `new_tokens` tokens (EOS is a
    token like any other here, so every policy is compared over the same steps)."""
    model = loaded.model
    device = model.output.weight.device
    tokens = torch.tensor(ids, device=device)[None]
    pos = torch.arange(len(ids) + new_tokens, device=device)[None]
    model.setup_caches(1, len(ids) + new_tokens, FullCache())
    out = []
    with torch.inference_mode():
        logits = run_prefill(model, tokens, pos[:, :len(ids)], loaded.prefill)
        for i in range(new_tokens):
            token = logits.argmax(-1)
            out.append(int(token))
            if i + 1 < new_tokens:
                at = len(ids) + i
                logits = run_decode(model, token[:, None], pos[:, at:at + 1], i, loaded.decode)
    return out


def compare(predicted: Sequence[int], ref: Sequence[int]) -> dict:
    """{first_divergence, token_agreement} of teacher-forced greedy choices against the reference."""
    same = [int(p) == int(r) for p, r in zip(predicted, ref)]
    first = next((i for i, s in enumerate(same) if not s), len(same))
    return {"first_divergence": first, "token_agreement": sum(same) / len(same)}


def evaluate(loaded: common.Loaded, new_policy: Callable, windows: list[tuple[int, list[int]]], new_tokens: int,
             references: Optional[list[list[int]]] = None, progress: Optional[common.Progress] = None) -> dict:
    """Every window with a fresh policy -> {score (token agreement %), first_divergence, results, usage}.
    `references` (the full cache's continuations) are computed when not given."""
    if references is None:
        references = [reference(loaded, ids, new_tokens) for _, ids in windows]
    usage, results = measure.Usage(), []
    for i, ((start, ids), ref) in enumerate(zip(windows, references)):
        policy = new_policy()
        logits = measure.forced_logits(loaded.model, torch.tensor(list(ids) + list(ref)), len(ids), policy,
                                       loaded.prefill, loaded.decode, usage)
        r = {"sample": i, "start": start, **compare(logits.argmax(-1).tolist(), ref)}
        results.append(r)
        if progress:
            progress.finish(f"sample {i}", f"first divergence {r['first_divergence']}, "
                                           f"agreement {r['token_agreement']:.3f}")
    agreement = 100 * sum(r["token_agreement"] for r in results) / len(results)
    first = sum(r["first_divergence"] for r in results) / len(results)
    return {"score": agreement, "metric": "token_agreement", "first_divergence": first, "new_tokens": new_tokens,
            "results": results, "usage": usage.as_dict(), "describe": policy.describe()}


# --------------------------------------------------------------------------- proximal agreement (POD Fig. 1c)

class ProximalCache(FullCache):
    """The full cache with every query restricted to its proximal keys: positions < n_sink, or
    within the last n_recent positions up to the query's own (kp > qp - n_recent)."""

    name = "proximal"

    def __init__(self, n_sink: int, n_recent: int):
        if n_sink < 0 or n_recent < 1:
            raise ValueError("n_sink must be >= 0 and n_recent >= 1")
        self.n_sink, self.n_recent = n_sink, n_recent

    def begin(self, input_pos, n_filled=None):
        super().begin(input_pos, n_filled)
        B, T = input_pos.shape
        qp = input_pos[:, :, None]
        kp = self.pos[:, None, :self.n_filled]
        near = (kp < self.n_sink) | (kp > qp - self.n_recent) | (qp < 0)
        near = near[:, None].expand(B, self.group, T, -1).reshape(B, self.group * T, -1)
        self.mask = self.mask & near

    def describe(self) -> dict:
        return {"policy": self.name, "n_sink": self.n_sink, "n_recent": self.n_recent}


def last_logits(model, ids: list[int], last: int, cache: Optional[FullCache] = None,
                chunk: int = 512) -> torch.Tensor:
    """Logits [last, V] (float32) at the last `last` positions of `ids`, from one chunked
    forward pass over the whole window with `cache` (`full` if None)."""
    device = model.output.weight.device
    tokens = torch.tensor(ids, device=device)[None]
    T = tokens.shape[1]
    pos = torch.arange(T, device=device)[None]
    model.setup_caches(1, T, cache)
    preds = []
    with torch.inference_mode():
        for s in range(0, T, chunk):
            logits = model(tokens[:, s:s + chunk], pos[:, s:s + chunk])[0]        # [t, V]
            keep = max(0, T - last - s)
            if keep < logits.shape[0]:
                preds.append(logits[keep:].float())
    return torch.cat(preds)


def proximal_agreement(loaded: common.Loaded, windows: list[tuple[int, list[int]]], sizes: Sequence[int],
                       n_sink: int, last: int, progress: Optional[common.Progress] = None) -> dict:
    """{size: share of the last `last` positions whose proximal-only prediction equals the full one}."""
    if any(n <= n_sink for n in sizes):
        raise UsageError(f"every --proximal size must exceed --n-sink {n_sink}")
    agree = {n: [] for n in sizes}
    for i, (_, ids) in enumerate(windows):
        full = last_logits(loaded.model, ids, last).argmax(-1)
        for n in sizes:
            near = last_logits(loaded.model, ids, last, ProximalCache(n_sink, n - n_sink)).argmax(-1)
            agree[n].append((near == full).float().mean().item())
            if progress:
                progress.finish(f"sample {i} proximal {n}", f"agreement {agree[n][-1]:.3f}")
    return {n: sum(v) / len(v) for n, v in agree.items()}


# --------------------------------------------------------------------------- CLI

def build_parser():
    p = common.base_parser(__doc__)
    p.add_argument("--text", help=f"text file (default: the .txt files of {common.ESSAYS}, sorted, concatenated)")
    p.add_argument("--context-length", type=int, default=2048, help="prompt tokens per sample (default: %(default)s)")
    p.add_argument("--new-tokens", type=int, default=64, help="reference tokens compared (default: %(default)s)")
    p.add_argument("--samples", type=int, default=2, help="consecutive windows of the text (default: %(default)s)")
    p.add_argument("--proximal", metavar="N1,N2,...", help="instead: POD Fig. 1(c) agreement for these proximal "
                                                           "sizes (n_sink + recent)")
    p.add_argument("--n-sink", type=int, default=16, help="initial tokens among the proximal ones (default: 16, "
                                                          "POD's n_s)")
    p.add_argument("--last", type=int, default=100, help="positions compared per window (default: 100, as POD)")
    return p


def run(args) -> int:
    if min(args.context_length, args.new_tokens, args.samples, args.last) < 1 or args.n_sink < 0:
        raise UsageError("--context-length, --new-tokens, --samples and --last must be at least 1, --n-sink >= 0")
    sizes = common.parse_ints(args.proximal, "--proximal") if args.proximal else None
    if sizes is not None and args.last > args.context_length:
        raise UsageError("--last exceeds --context-length")
    common.new_policy(args)
    text = common.read_text_file(args.text) if args.text else common.read_text_folder(common.ESSAYS)
    loaded = common.load(args)
    window = args.context_length + (0 if sizes else args.new_tokens)
    common.check_fits(loaded, window, "the window")
    windows = text_windows(loaded.tokenizer, text, args.context_length, args.samples)
    if sizes:
        shares = proximal_agreement(loaded, windows, sizes, args.n_sink, args.last,
                                    common.Progress(len(windows) * len(sizes)))
        print(f"{'proximal':>8}  {'agreement':>9}   (last {args.last} positions of {args.samples} x "
              f"{args.context_length} tokens, n_sink {args.n_sink})")
        for n, share in shares.items():
            print(f"{n:>8}  {share:9.3f}")
        if args.json:
            common.write_json(args.json, {"checkpoint": str(args.checkpoint), "context_length": args.context_length,
                                          "samples": args.samples, "last": args.last, "n_sink": args.n_sink,
                                          "proximal_agreement": {str(n): s for n, s in shares.items()}})
        return 0
    result = evaluate(loaded, lambda: common.new_policy(args), windows, args.new_tokens,
                      progress=common.Progress(len(windows)))
    print(f"token agreement {result['score']:.1f}%, mean first divergence {result['first_divergence']:.1f} of "
          f"{args.new_tokens} tokens ({args.samples} x {args.context_length} context), policy {result['describe']}")
    if args.json:
        common.write_json(args.json, {**common.report_header(args), "context_length": args.context_length,
                                      **result})
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    return common.main_wrapper(run, build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
