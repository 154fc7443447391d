"""POD (Ma et al., 2025): proximal tokens over distant tokens, with inter-layer attention sharing.

Every token is kept; distant tokens get fewer resources.  For a decode query at position p, the
*proximal* tokens are the first `n_sink` positions and the last `n_recent` (p - n_recent, p]
(the current token included); the others are *distant*.  Layers are grouped per KV head into
*blocks* of consecutive layers; within a block, the distant tokens' attention logits are those of
the block's first layer (its queries and keys), so only that layer stores distant keys.  Values
stay per layer.  Per layer and query head (paper eq. 3-4):

    a_P = q_l K_l,P / sqrt(d)            o_P = softmax(a_P) V_l,P
    a_D = q_first K_first,D / sqrt(d)    o_D = softmax(a_D) V_l,D
    g   = sum exp a_P / (sum exp a_P + sum exp a_D) = sigmoid(lse(a_P) - lse(a_D))
    o   = g o_P + (1 - g) o_D

which is exactly one softmax over the concatenated logits [a_P; a_D] (Appendix A.1): with every
layer its own block, POD *is* full attention.  With `tau` in [0, 1], a non-first layer whose gate
reaches tau uses o_P alone (the paper's skipped distant computation); `describe()` reports the
fraction of gates (non-first layers, query heads, steps with distant tokens) that skipped.  The
skip is applied as a mask: the distant part is still computed, so this measures the accuracy side
of the trade-off, not a speed-up (a per-head branch would need a data-dependent kernel).

GQA: keys are stored per KV head, so blocks are per KV head (the similarity of a KV head is the
mean over its query heads); query head j of a non-first layer uses query head j's distant logits
of the block's first layer (the same index inside the same KV head's group).

Blocks (offline calibration, paper sec. 2.1 and Algorithm 1; `scripts/calibrate_pod.py`): the
attention rows of the last q prompt tokens of each layer and query head; similarity of two layers
= mean over rows (and samples, and the query heads of a KV head) of 1 - JSD(row_a, row_b), with
the Jensen-Shannon divergence in log base 2 (so it lies in [0, 1] and 1 means identical rows);
greedy grouping of consecutive layers: a layer joins the current block when its similarity to
*every* layer of the block is >= sim_threshold (the paper's delta).  `blocks=auto` regroups the similarities stored in
`pod_calibration.json` next to the checkpoint with this policy's sim_threshold; `prepare` (engine.generate,
the evals and the benchmark call it) calibrates that file on data/calibration/ the first time it is
needed (cache/calibration.py).  Without the file, and with `blocks=prompt`, the blocks come from the
prompt's own last `cal_queries` queries; `blocks=layers` makes every layer its own block,
`blocks=PATH` reads another file.  The similarity, the grouping and the file are cache/calibration.py's.

Storage per layer l (B rows, H KV heads, D head_dim; every token's K and V stored once):
    ring_k, ring_v [B, H, R, D]        proximal tokens: slots [0, n_sink) hold positions 0..n_sink-1,
                                       slots n_sink + (p - n_sink) % n_recent the recent ring
    dist_v         [B, H, C_D, D]      distant tokens' values, every layer
    dist_k         [B, H_first(l), C_D, D]  distant keys, only for the KV heads whose block starts at l
R = n_sink + n_recent; C_D = max_seq_length - R.  A decode token enters the ring; the token it
replaces (position p - n_recent) moves to the distant store, which therefore fills in order of
exit (slot j = position n_sink + j): append-only, the access pattern of KIVI's block-wise key
flush, with the ring as the full-precision residual.  Bytes saved against the full cache:
(L H - #blocks) (C - R) D / (2 L H C D): kv_bytes() reports the buffers, so it matches exactly.

Prefill: the whole prompt in one pass with full causal attention (so the first generated token
is the full cache's), then the prompt's K/V are filed into ring and distant store; decode runs
POD.  Prompts must be left-padded with positions 0..len-1 per row (what engine.generate and the
evals pass).  With `budget` > 0 (the paper's POD+SnapKV) the distant *prompt* tokens are also
selected SnapKV-style: per KV head, the block's first layer scores them (observation window of the
last `obs_window` queries, fp32 softmax, group mean, pooling) and the whole block keeps the same top
budget - R of them, so shared logits and per-layer values stay aligned slot for slot.

Decode is sync-free and shape-stable: the configuration (which layer starts a block for which
head) is host data fixed after prefill; every step reads the ring (R slots, masked) and the
distant prefix that can hold tokens (a dynamic int from n_filled, at least 2 so compiled graphs
never hit a size-0/1 specialization; a static step, the one a CUDA graph replays, reads it rounded up to
a bucket, cache.full.read_bound, its empty slots masked).

KIVI (--kv-bits): not wired yet.  The hook is the distant store: `dist_logits` (keys of the first
layers, q . K) and `dist_read` (probabilities x values, with its log-sum-exp) are the only reads
of it, and `_store` is its only write (one exiting token per step, in order).  A quantized store
must offer exactly these two reads; KIVI's `attend` fuses them, so it needs splitting first.

    python engine.py --checkpoint C --policy pod:sim_threshold=0.5
    python engine.py --checkpoint C --policy pod:sim_threshold=0.5,budget=2048   # POD+SnapKV
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

from cache.base import EvictionPolicy
from cache.full import read_bound
from cache.slots import scatter_into
from cache.scoring import NEVER, column_scores, pool1d, select_top
from cache.calibration import (POD_FILE, attention_rows, ensure_pod, group_heads, key_saving, pod_path, read_pod_file,
                               similarity_sums)
from cache.params import param, param_values
from model import ModelArgs, grouped_attention

# --------------------------------------------------------------------------- attention pieces

def partial_attention(logits: Tensor, visible: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Softmax attention over one part of the keys: logits [B, H, G, S] fp32, visible (bool,
    broadcastable), v [B, H, S, D] -> (out [B, H, G, D] fp32, lse [B, H, G]); a row with nothing
    visible gives out 0 and lse -inf (no NaN)."""
    s = logits.masked_fill(~visible, NEVER)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    return p @ v.float(), lse


def gather_rows(x: Tensor, idx: Tensor) -> Tensor:
    """x [B, H, T, D] at token indices idx [B, 1 or H, n] -> [B, H, n, D]."""
    B, H, _, D = x.shape
    return x.gather(2, idx.expand(B, H, -1)[..., None].expand(-1, -1, -1, D))


# --------------------------------------------------------------------------- the policy

@dataclass(eq=False)
class PODPolicy:
    """POD as a cache policy (contract: cache/contract.py); see the module docstring."""
    admission = "batch"     # layer blocks and distant-token storage are set per batch
    decode_room = None      # (admission "batch": storage follows each batch's prompt)

    name = "pod"
    n_sink: int = param(16, "n_s: first tokens always attended by every layer (proximal)")
    n_recent: int = param(-1, "n_r: last tokens attended by every layer, the current one included (-1: context/8 - "
                              "n_sink, the paper's 16 + 4080 of 32K scaled)")
    sim_threshold: float = param(0.5, "the paper's delta: layer-similarity threshold of the greedy grouping (> 1: "
                                      "every layer its own block)")
    tau: float = param(-1.0, "skip distant attention in non-first layers when the gate g >= tau (-1: off)")
    blocks: str = param("auto", f"auto ({POD_FILE} next to the checkpoint, calibrated on first use), prompt, layers "
                                f"(no sharing), or a path to a calibration JSON")
    cal_queries: int = param(16, "last prompt queries whose attention rows calibrate blocks=prompt")
    budget: int = param(0, "POD+SnapKV: prompt tokens kept per layer and KV head, proximal included (0: keep every "
                           "token)")
    obs_window: int = param(32, "SnapKV observation window (with budget)")
    kernel: int = param(7, "SnapKV pooling kernel (odd; with budget)")
    pooling: str = param("max", "SnapKV pooling: max or avg (with budget)")
    renamed = {"window": "obs_window", "delta": "sim_threshold"}
    prefill_in_one_pass = True
    prefix_reuse = False
    is_sparse_reader = False
    decode_attention = False
    reader_composable = False    # keeps storage of its own (ring + distant store)
    storage_kind = "own"         # a proximal ring and a distant store (module doc)
    static_decode = True         # a static step's one int is its distant read bound (begin_static_step)
    kv_bits, kv_group = 16, 0
    n_filled = 0

    @classmethod
    def full_cache_args(cls, n_tokens: int):
        """Every layer its own block: every layer keeps its own distant keys (tested equal to full)."""
        return {"blocks": "layers"}

    defer_compression = True     # EvictionPolicy.before_prefill/begin (reused) leave allocation to us
    staged = None                # (read by EvictionPolicy.begin) never staged: the prompt comes in one pass, as
    check_chunk = EvictionPolicy.check_chunk     # its ring and distant store are filed from the whole prompt

    def __post_init__(self):
        self.args = None             # the model's shape (setup)
        if self.n_sink < 0 or self.n_recent == 0 or self.n_recent < -1:
            raise ValueError(f"need n_sink >= 0 and n_recent >= 1 (or -1), got {self.n_sink}, {self.n_recent}")
        if self.tau > 1:
            raise ValueError(f"tau must be in [0, 1] (or negative: off), got {self.tau}")
        if self.cal_queries < 1 or self.obs_window < 1 or self.budget < 0:
            raise ValueError("cal_queries and obs_window must be at least 1, budget at least 0")
        if self.kernel < 1 or self.kernel % 2 == 0 or self.pooling not in ("max", "avg"):
            raise ValueError(f"kernel must be odd and positive and pooling max or avg, got {self.kernel}, {self.pooling!r}")
        if self.blocks not in ("auto", "prompt", "layers") and not Path(self.blocks).exists():
            raise ValueError(f"blocks={self.blocks}: no such file (or auto, prompt, layers)")

    # ----------------------------------------------------------------- setup
    def setup(self, args: ModelArgs, max_batch_size: int, max_seq_length: int, dtype, device) -> None:
        self.args, self.batch, self.dtype, self.device = args, max_batch_size, dtype, device
        self.group = args.n_heads // args.n_kv_heads
        self.sliding_window = args.sliding_window
        self.max_seq_length = max_seq_length
        self.n_r = self.n_recent if self.n_recent > 0 else max(1, args.max_position_embeddings // 8 - self.n_sink)
        self.R = self.n_sink + self.n_r
        if self.budget and self.budget < self.R:
            raise ValueError(f"budget ({self.budget}) must cover the proximal tokens n_sink + n_recent = {self.R}")
        self.fixed_blocks, self.similarity, self.blocks_source = self.load_blocks(args)
        self.skipped = torch.zeros((), dtype=torch.long, device=device)
        self.gated = torch.zeros((), dtype=torch.long, device=device)
        self.ring_k = self.ring_v = self.dist_k = self.dist_v = None
        self.reset()

    def prepare(self, model, tokenizer) -> None:
        """blocks=auto: make the checkpoint's pod_calibration.json (on data/calibration/) if it is missing."""
        if self.blocks == "auto" and model.args.checkpoint is not None:
            ensure_pod(model, tokenizer, model.args.checkpoint)

    def load_blocks(self, args: ModelArgs):
        """(blocks or None = calibrate on the prompt, similarity or None, description of the source)."""
        L, H = args.n_layers, args.n_kv_heads
        if self.blocks == "layers":
            return [[[i] for i in range(L)] for _ in range(H)], None, "layers: every layer its own block"
        if self.blocks == "prompt":
            return None, None, "prompt"
        if self.blocks == "auto":
            if args.checkpoint is None or not pod_path(args.checkpoint).exists():
                return None, None, "prompt"
            path = pod_path(args.checkpoint)
        else:
            path = Path(self.blocks)
        blocks, sim = read_pod_file(path, args, self.sim_threshold)
        return blocks, sim, str(path)

    def release(self, row: int) -> None:
        raise ValueError("pod admits whole batches (admission 'batch'): rows cannot leave one by one")

    def adopt(self, row: int, other, other_row: int = 0) -> None:
        raise ValueError("pod admits whole batches (admission 'batch'): rows cannot join a running batch")

    def question_room(self, row: int) -> Optional[int]:
        return None                 # every token is kept

    def hold_question(self, row: int, start: int, end: int) -> None:
        pass

    def reset(self) -> None:
        self.n_filled = 0
        self.prompt_length = 0
        self.prepared = False
        self.configured = False
        self.pending: dict = {}
        self.rows: dict = {}
        self.q_pos = None
        self.head_blocks = self.fixed_blocks
        self.skipped.zero_()
        self.gated.zero_()

    # ----------------------------------------------------------------- prefill
    def before_prefill(self, input_pos: Tensor) -> None:
        """Host side, once per request: check the prompt layout, fix where every prompt token goes
        (ring / distant slots) and, when the blocks are known, allocate the storage."""
        EvictionPolicy.before_prefill(self, input_pos)     # one pass, batch, length; sets prompt_length
        B, T = input_pos.shape
        lens = (input_pos >= 0).sum(1)
        expect = torch.arange(T, device=input_pos.device) - (T - lens)[:, None]
        if not torch.equal(input_pos, expect.clamp(min=-1)):
            raise ValueError("pod needs left-padded prompts with positions 0..len-1 in each row")
        self.lens = lens
        ns, nr = self.n_sink, self.n_r
        first_exit = torch.clamp(lens - nr, min=ns)       # first position to leave the ring in decode
        # ring slots: sinks at their position, recent positions p >= n_sink at n_sink + (p - n_sink) % n_r
        self.R_alloc = min(self.R, self.max_seq_length)
        slot = torch.arange(self.R_alloc, device=input_pos.device)
        recent = first_exit[:, None] + (slot - first_exit[:, None]) % nr           # [B, R] positions
        ring_pos = torch.where(slot < ns, slot.expand(B, -1), recent)
        self.ring_pos = torch.where(ring_pos < lens[:, None], ring_pos, -1)
        self.ring_src = (self.ring_pos + (T - lens)[:, None]).clamp(0, T - 1)[:, None]   # input index
        # distant prompt tokens (positions n_sink .. first_exit - 1); decode exits follow in order
        self.n_prompt_distant = max(0, T - self.R)
        self.C_sel = min(self.budget - self.R, self.n_prompt_distant) if self.budget else self.n_prompt_distant
        if self.budget:
            self.offset = first_exit - self.C_sel          # decode-exit slot j holds position j + offset
            self.C_D = self.C_sel + max(0, self.max_seq_length - nr - max(ns, T - nr))
        else:
            self.offset = torch.full_like(lens, ns)
            self.C_D = max(0, self.max_seq_length - self.R)
            j = torch.arange(self.n_prompt_distant, device=input_pos.device)
            self.dist_src = (j + ns + (T - lens)[:, None]).clamp(0, T - 1)[:, None]       # [B, 1, n]
        self.offset_long = int(self.offset[lens.argmax()])
        if self.head_blocks is not None:
            self.configure(self.head_blocks)

    def configure(self, head_blocks: list) -> None:
        """Fix the block structure (host data) and allocate every layer's storage."""
        L, H, D, B = self.args.n_layers, self.args.n_kv_heads, self.args.head_dim, self.batch
        self.head_blocks = head_blocks
        self.first = [[False] * H for _ in range(L)]
        for h, blocks in enumerate(head_blocks):
            for block in blocks:
                self.first[block[0]][h] = True
        self.first_heads = [[h for h in range(H) if self.first[layer][h]] for layer in range(L)]
        self.follower = [torch.tensor([not f for f in self.first[layer]], device=self.device)[None, :, None]
                         for layer in range(L)]                                     # [1, H, 1]
        z = dict(dtype=self.dtype, device=self.device)
        self.ring_k = [torch.zeros(B, H, self.R_alloc, D, **z) for _ in range(L)]
        self.ring_v = [torch.zeros(B, H, self.R_alloc, D, **z) for _ in range(L)]
        self.dist_v = [torch.zeros(B, H, self.C_D, D, **z) if self.C_D else None for _ in range(L)]
        self.dist_k = [torch.zeros(B, len(self.first_heads[layer]), self.C_D, D, **z)
                       if self.C_D and self.first_heads[layer] else None for layer in range(L)]
        self.sel_pos = [None] * L            # budget: distant prompt positions per layer [B, H, C_sel]
        self.head_sel: dict = {}             # budget: the current block's selection per KV head
        self.configured = True

    def begin(self, input_pos: Tensor, n_filled: Optional[int] = None) -> None:
        """Once per forward: the prompt/step bookkeeping is EvictionPolicy's (the same attributes:
        one-pass prompt, n_filled, q_pos, the prompt's mask); a decode step then places its token."""
        EvictionPolicy.begin(self, input_pos, n_filled)
        if self.n_filled > input_pos.shape[1]:
            self.begin_step(input_pos[:, 0], torch.sym_min(self.C_D, self.dist_live()))

    def begin_static_step(self) -> int:
        """Host side, before a static decode step: EvictionPolicy's (n_filled advanced) -> the distant slots the
        step reads: those any row may have filled, rounded up to cache.full.read_bound's bucket, at most C_D."""
        EvictionPolicy.begin_static_step(self)
        return read_bound(self.dist_live(), self.C_D)

    def begin_static(self, input_pos: Tensor, n_read: int) -> None:
        self.q_pos = input_pos
        self.begin_step(input_pos[:, 0], n_read)

    def static_tensors(self) -> list[Tensor]:
        """The ring and distant store, the slot bookkeeping, the followers' masks and the gate counters."""
        per_layer = [t for ts in (self.ring_k, self.ring_v, self.dist_k, self.dist_v, self.sel_pos, self.follower)
                     for t in ts if t is not None]
        return per_layer + [self.ring_pos, self.offset, self.skipped, self.gated]

    def prefill(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        out = grouped_attention(q, k, v, self.mask)
        obs = None
        if self.budget and (not self.configured or self.first_heads[layer]):    # SnapKV scores
            obs = column_scores(q, k, self.q_pos, self.obs_window, self.sliding_window)
        if self.configured:
            self.file_prompt(layer, k, v, obs)
        else:
            self.rows[layer] = attention_rows(q, k, self.q_pos, self.cal_queries, self.sliding_window)
            self.pending[layer] = (k, v, obs)
        return out

    def end_prefill(self) -> None:
        """Calibrate on the prompt when the blocks were not given, then file the waiting layers."""
        if not self.pending:
            return
        L = self.args.n_layers
        valid = torch.nn.functional.pad(self.q_pos, (self.cal_queries, 0), value=-1)[:, -self.cal_queries:] >= 0
        sums, count = similarity_sums([self.rows.pop(layer) for layer in range(L)], valid)
        self.similarity = sums / max(count, 1)
        self.configure(group_heads(self.similarity, self.sim_threshold))
        for layer in range(L):
            self.file_prompt(layer, *self.pending.pop(layer))

    def file_prompt(self, layer: int, k: Tensor, v: Tensor, obs: Optional[Tensor]) -> None:
        """The prompt's K/V [B, H, T, D] into the layer's ring and distant store."""
        self.ring_k[layer].copy_(gather_rows(k, self.ring_src))
        self.ring_v[layer].copy_(gather_rows(v, self.ring_src))
        if not self.C_sel:
            return
        heads = self.first_heads[layer]
        if self.budget:
            idx = self.select_distant(layer, heads, obs)                     # [B, H, C_sel]
        else:
            idx = self.dist_src
        n = idx.shape[-1]
        self.dist_v[layer][:, :, :n] = gather_rows(v, idx)
        if heads:
            self.dist_k[layer][:, :, :n] = gather_rows(k[:, heads], idx[:, heads] if self.budget else idx)

    def select_distant(self, layer: int, heads: list[int], obs: Tensor) -> Tensor:
        """POD+SnapKV: the block's first layer picks each KV head's distant prompt tokens by SnapKV
        scores; the rest of the block reuses them.  Returns input indices [B, H, C_sel] (in
        position order) and records the layer's positions in sel_pos (-1 = empty slot)."""
        pos = self.q_pos
        T = pos.shape[1]
        candidate = (pos >= self.n_sink) & (pos < self.lens[:, None] - self.n_r)             # [B, T]
        if heads:
            scores = pool1d(obs[:, heads], self.kernel, self.pooling, within=candidate[:, None])
            idx, ok = select_top(scores.masked_fill(~candidate[:, None], NEVER), self.C_sel)
            for i, h in enumerate(heads):
                self.head_sel[h] = (idx[:, i], ok[:, i])
        H = self.args.n_kv_heads
        idx = torch.stack([self.head_sel[h][0] for h in range(H)], 1)
        ok = torch.stack([self.head_sel[h][1] for h in range(H)], 1)
        self.sel_pos[layer] = torch.where(ok, pos[:, None].expand(-1, H, -1).gather(2, idx.clamp(max=T - 1)), -1)
        return idx

    # ----------------------------------------------------------------- decode
    def begin_step(self, p: Tensor, n) -> None:
        """Per decode step (all layers): the new token's ring slot, the token it pushes into the
        distant store and that store's slot, and the visibility of both parts.  p [B] positions; n the
        distant slots read (its empty ones masked)."""
        ns, nr = self.n_sink, self.n_r
        slot = torch.where(p < ns, p, ns + (p - ns) % nr).clamp(max=self.R_alloc - 1)
        leaving = self.ring_pos.gather(1, slot[:, None])[:, 0]
        self.step_slot = slot
        self.shared: dict = {}      # this step's distant logits of the current block, per KV head
        self.step_move = leaving >= ns                                           # a recent token leaves
        self.step_dist_slot = (leaving - self.offset).clamp(0, max(self.C_D - 1, 0))
        self.ring_pos.scatter_(1, slot[:, None], p[:, None])
        rp = self.ring_pos
        ring_vis = (rp >= 0) & (rp <= p[:, None])
        if self.sliding_window:
            ring_vis &= p[:, None] - rp < self.sliding_window
        self.ring_vis = ring_vis[:, None, None]                                  # [B, 1, 1, R]
        if self.C_D:
            j = torch.arange(n, device=p.device)
            dpos = j + self.offset[:, None]                                      # decode-exit positions
            vis = (dpos <= p[:, None] - nr) & (j >= (self.C_sel if self.budget else 0))
            if self.sliding_window:
                vis &= p[:, None] - dpos < self.sliding_window
            self.dist_vis = vis[:, None, None]                                   # [B, 1, 1, n]

    def dist_live(self):
        """Distant slots any row may have filled (a dynamic int under compile), at least 2 (compiled graphs
        specialize sizes 0 and 1); a step reads them up to C_D."""
        live = self.n_filled - self.n_r - self.offset_long
        if self.budget:
            live = torch.sym_max(live, self.C_sel)
        return torch.sym_max(live, 2)

    def decode(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        B, Hq, _, D = q.shape
        H = k.shape[1]
        self._store(layer, k, v)
        qg = q.reshape(B, H, Hq // H, D).float()
        scale = 1 / math.sqrt(D)
        out, lse_p = partial_attention((qg @ self.ring_k[layer].float().transpose(-1, -2)) * scale,
                                       self.ring_vis, self.ring_v[layer])
        if self.C_D:
            n = self.dist_vis.shape[-1]
            logits = self.dist_logits(layer, qg, n) * scale
            vis = self.dist_vis
            if self.budget:     # the selected prompt part differs per head (per block)
                sel = self.sel_pos[layer] >= 0
                if self.sliding_window:
                    sel &= self.q_pos.reshape(B, 1, 1) - self.sel_pos[layer] < self.sliding_window
                vis = vis | torch.nn.functional.pad(sel, (0, n - self.C_sel))[:, :, None, :n]
            o_d, lse_d = self.dist_read(layer, logits, vis, n)
            g = torch.sigmoid(lse_p - lse_d)[..., None]                         # the gate (eq. 4)
            mixed = g * out + (1 - g) * o_d
            if self.tau >= 0:
                skip = (g >= self.tau) & self.follower[layer][..., None]
                has_distant = torch.isfinite(lse_d)[..., None] & self.follower[layer][..., None]
                self.skipped.add_((skip & has_distant).sum())
                self.gated.add_(has_distant.sum())
                mixed = torch.where(skip, out, mixed)
            out = mixed
        return out.to(q.dtype).reshape(B, Hq, 1, D)

    def _store(self, layer: int, k: Tensor, v: Tensor) -> None:
        """The token leaving the ring moves to the distant store (its value always, its key in the
        heads whose block starts here); then the new token takes its ring slot."""
        B, H, _, D = k.shape
        ring = self.step_slot[:, None, None, None].expand(B, H, 1, D)
        if self.C_D:
            at = self.step_dist_slot[:, None, None, None].expand(B, H, 1, D)
            move = self.step_move[:, None, None, None]
            stores = [(self.dist_v[layer], self.ring_v[layer])]
            heads = self.first_heads[layer]
            if heads:
                stores.append((self.dist_k[layer], self.ring_k[layer][:, heads]))
            for dst, src in stores:
                h = dst.shape[1]
                cur = dst.gather(2, at[:, :h])
                scatter_into(dst, 2, at[:, :h], torch.where(move, src.gather(2, ring[:, :h]), cur))
        scatter_into(self.ring_k[layer], 2, ring, k)
        scatter_into(self.ring_v[layer], 2, ring, v)

    def dist_logits(self, layer: int, qg: Tensor, n) -> Tensor:
        """Distant logits q . k [B, H, G, n] (unscaled): computed by the KV heads whose block starts
        at this layer, taken from the block's first layer (earlier in this step) by the others."""
        heads = self.first_heads[layer]
        if heads:
            own = qg[:, heads] @ self.dist_k[layer][:, :, :n].float().transpose(-1, -2)
            for i, h in enumerate(heads):
                self.shared[h] = own[:, i]
        return torch.stack([self.shared[h] for h in range(qg.shape[1])], 1)

    def dist_read(self, layer: int, logits: Tensor, visible: Tensor, n) -> tuple[Tensor, Tensor]:
        """o_D and its log-sum-exp from this layer's distant values."""
        return partial_attention(logits, visible, self.dist_v[layer][:, :, :n])

    def before_decode_step(self, step: int) -> None:
        pass

    # ----------------------------------------------------------------- introspection
    def storage(self, layer: int):
        raise NotImplementedError("pod stores distant keys only in the first layer of each block: "
                                  "it cannot serve as the storage of a sparse reader")

    def distant_positions(self, layer: int) -> Tensor:
        """Positions held by the distant store [B, H, C_D] (-1 = empty)."""
        B, H = self.batch, self.args.n_kv_heads
        if not self.C_D:
            return torch.full((B, H, 0), -1, dtype=torch.long, device=self.device)
        last = self.q_pos[:, -1:]
        j = torch.arange(self.C_D, device=self.device)
        pos = j + self.offset[:, None]
        pos = torch.where((pos <= last - self.n_r) & (pos >= self.n_sink), pos, -1)[:, None].expand(B, H, -1)
        if self.budget:
            pos = torch.cat([self.sel_pos[layer], pos[:, :, self.C_sel:]], -1)
        return pos

    def kept_positions(self, layer: int) -> Tensor:
        B, H = self.batch, self.args.n_kv_heads
        return torch.cat([self.ring_pos[:, None].expand(B, H, -1), self.distant_positions(layer)], -1)

    def key_positions(self, layer: int) -> Tensor:
        """Positions whose keys this layer stores [B, H, n] (-1 = none): the ring for every head, the
        distant store only for heads whose block starts at the layer."""
        pos = self.kept_positions(layer)
        follower = torch.tensor([not f for f in self.first[layer]], device=self.device)
        distant = torch.zeros_like(pos, dtype=torch.bool)
        distant[:, :, self.R_alloc:] = True
        return pos.masked_fill(distant & follower[None, :, None], -1)

    def kv_bytes(self) -> dict:
        if not self.configured:
            return {"allocated": 0, "live": 0, "read_per_step": 0}
        L = self.args.n_layers

        def row(t):        # bytes of one slot of a [B, h, S, D] buffer
            return 0 if t is None else t.shape[0] * t.shape[1] * t.shape[3] * t.element_size()
        bufs = [(self.ring_k[i], self.ring_v[i], self.dist_k[i], self.dist_v[i]) for i in range(L)]
        allocated = sum(t.numel() * t.element_size() for b in bufs for t in b if t is not None)
        ring_used = min(self.R_alloc, self.n_filled)
        dist_used = min(self.C_D, max(0, self.n_filled - self.n_r - self.offset_long,
                                      self.C_sel if self.budget else 0))
        live = sum(ring_used * (row(rk) + row(rv)) + dist_used * (row(dk) + row(dv)) for rk, rv, dk, dv in bufs)
        read = sum(self.R_alloc * (row(rk) + row(rv)) + (max(2, dist_used) if self.C_D else 0) * (row(dk) + row(dv))
                   for rk, rv, dk, dv in bufs)
        return {"allocated": allocated, "live": live, "read_per_step": read}

    def skip_fraction(self) -> Optional[float]:
        """Fraction of gate evaluations (non-first layers x query heads x rows x steps with distant
        tokens) whose distant attention was skipped (g >= tau); None when tau is off or none ran."""
        gated = int(self.gated)
        return None if self.tau < 0 or not gated else int(self.skipped) / gated

    def describe(self) -> dict:
        d = {"policy": self.name, **param_values(self)}
        if self.args is None:                               # not set up yet
            return d
        L = self.args.n_layers
        d.update(n_recent=self.n_r, proximal=self.R, blocks_source=self.blocks_source)
        if self.head_blocks is not None:
            H = len(self.head_blocks)
            d["blocks_per_head"] = [len(b) for b in self.head_blocks]
            d["block_ranges"] = [[[b[0], b[-1]] for b in blocks] for blocks in self.head_blocks]
            d["theoretical_kv_saving"] = round(key_saving(self.head_blocks, L), 4)
            d["first_layer_share"] = round(sum(len(b) for b in self.head_blocks) / (L * H), 4)
            if self.configured:
                d["theoretical_kv_saving_here"] = round(key_saving(self.head_blocks, L, self.R_alloc + self.C_D,
                                                                   self.R_alloc), 4)
        if self.similarity is not None and self.head_blocks is not None:
            inner = [float(self.similarity[h, i, j]) for h, blocks in enumerate(self.head_blocks)
                     for b in blocks for i in b for j in b if i > j]
            d["mean_similarity_within_blocks"] = round(sum(inner) / len(inner), 4) if inner else None
        if self.tau >= 0:
            d["skipped_fraction"] = self.skip_fraction()
        return d
