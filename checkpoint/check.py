"""What every reader checks a checkpoint against before it reads tensor data: the tensors (HF names and
shapes) its config describes and finite RoPE frequencies.  CheckpointError, the one error a bad
checkpoint raises."""
from __future__ import annotations

import torch

from model import ModelArgs, rope_inv_freq


class CheckpointError(ValueError):
    """A checkpoint that is missing, truncated, or not something this engine can run."""


def expected_shapes(args: ModelArgs) -> dict[str, tuple]:
    """HF name -> shape of every tensor a model with these args has (the head only when untied)."""
    D, F, V = args.dim, args.intermediate_size, args.vocab_size
    q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    shapes = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
    if not args.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, D)
    for i in range(args.n_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (q, D), p + "self_attn.k_proj.weight": (kv, D),
                       p + "self_attn.v_proj.weight": (kv, D), p + "self_attn.o_proj.weight": (D, q),
                       p + "mlp.gate_proj.weight": (F, D), p + "mlp.up_proj.weight": (F, D),
                       p + "mlp.down_proj.weight": (D, F), p + "input_layernorm.weight": (D,),
                       p + "post_attention_layernorm.weight": (D,)})
        if args.attention_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
    return shapes


def _ignored_tensor(name: str, args: ModelArgs) -> bool:
    """Tensors some checkpoints carry that the model does not use (RoPE buffers, a tied head's copy)."""
    return name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and args.tie_word_embeddings)


def check_config(args: ModelArgs, shapes: dict, where) -> None:
    """CheckpointError unless the checkpoint's tensors (HF name -> shape) are exactly the ones the config
    describes, and its RoPE settings give finite frequencies.  Runs before any model is built, so a
    corrupt layer count or dimension never allocates."""
    if args.n_layers * 9 > len(shapes):
        raise CheckpointError(f"{where}: the config describes {args.n_layers} layers, the checkpoint holds only "
                              f"{len(shapes)} tensors")
    want = expected_shapes(args)
    missing = [name for name in want if name not in shapes]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{where}: checkpoint is missing tensor {missing[0]}{more}")
    for name, shape in want.items():
        if tuple(shapes[name]) != shape:
            raise CheckpointError(f"{where}: tensor {name} has shape {list(shapes[name])}, the config needs {list(shape)}")
    extra = sorted(name for name in shapes if name not in want and not _ignored_tensor(name, args))
    if extra:
        raise CheckpointError(f"{where}: unexpected tensor(s) {', '.join(extra[:3])} (not part of the "
                              f"{args.n_layers}-layer model the config describes)")
    check_rope(args, where)


def check_rope(args: ModelArgs, where) -> None:
    """CheckpointError unless the RoPE settings give finite frequencies (a bad scaling dict fails here,
    not when the first request sets up its cache)."""
    try:
        inv_freq = rope_inv_freq(args)
    except (KeyError, TypeError, ValueError, ZeroDivisionError, RuntimeError) as e:
        raise CheckpointError(f"{where}: invalid RoPE scaling {str(args.rope_scaling)[:80]} ({type(e).__name__}: "
                              f"{e})") from None
    if not torch.isfinite(inv_freq).all():
        raise CheckpointError(f"{where}: RoPE theta {args.rope_theta} with scaling {str(args.rope_scaling)[:80]} "
                              f"gives non-finite frequencies")
