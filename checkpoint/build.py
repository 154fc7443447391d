"""HF-named tensors -> a `model.Transformer`: renamed and fused (q|k|v, gate|up), the model constructed on
the meta device, the tensors assigned (each QWeight as a QuantizedLinear), the CPU kernels plugged in."""
from __future__ import annotations

import torch

from checkpoint.check import CheckpointError
from checkpoint.memory import release_freed_memory
from kernels.cpu import (cpu_eager_ops, cpu_kernels_available, decode_attention, prefix_attention_cpu,
                         use_linear_kernel)
from kernels.qlinear import QuantizedEmbedding, QuantizedLinear, QWeight, dequantize
from model import ModelArgs, Transformer


def cat_rows(parts: list):
    """Concatenate weights along the output rows: float tensors, or QWeights of one format (exact);
    a mix is dequantized to fp32 first."""
    if not any(isinstance(p, QWeight) for p in parts):
        return torch.cat(parts)
    first = parts[0]
    same = all(isinstance(p, QWeight) and (p.bits, p.group, p.mins is None) == (first.bits, first.group, first.mins is None)
               for p in parts)
    if not same:
        return torch.cat([dequantize(p) if isinstance(p, QWeight) else p.float() for p in parts])
    cat = lambda attr: None if first.mins is None and attr == "mins" else torch.cat([getattr(p, attr) for p in parts])
    return QWeight(cat("qweight"), cat("scales"), cat("mins"), first.bits, first.group)



def engine_state_dict(args: ModelArgs, hf: dict, consume: bool = False) -> dict:
    """Rename HF tensors to model.py's names, fusing q|k|v and gate|up (float tensors or QWeights);
    consume=True pops them from `hf` (the unfused parts are freed as soon as they are fused)."""
    def take(name):
        if name not in hf:
            raise CheckpointError(f"checkpoint is missing tensor {name}")
        return hf.pop(name) if consume else hf[name]

    sd = {"tok_embeddings.weight": take("model.embed_tokens.weight"),
          "norm.weight": take("model.norm.weight")}
    if not args.tie_word_embeddings:
        sd["output.weight"] = take("lm_head.weight")
    for i in range(args.n_layers):
        p, a = f"model.layers.{i}.", f"layers.{i}."
        attn = [take(f"{p}self_attn.{n}_proj.weight") for n in "qkv"]
        sd[a + "attention.wqkv.weight"] = cat_rows(attn)
        if args.attention_bias:
            sd[a + "attention.wqkv.bias"] = torch.cat([take(f"{p}self_attn.{n}_proj.bias") for n in "qkv"])
        sd[a + "attention.wo.weight"] = take(f"{p}self_attn.o_proj.weight")
        sd[a + "feed_forward.w13.weight"] = cat_rows([take(f"{p}mlp.gate_proj.weight"), take(f"{p}mlp.up_proj.weight")])
        sd[a + "feed_forward.w2.weight"] = take(f"{p}mlp.down_proj.weight")
        sd[a + "attention_norm.weight"] = take(f"{p}input_layernorm.weight")
        sd[a + "ffn_norm.weight"] = take(f"{p}post_attention_layernorm.weight")
        if consume:
            del attn
            release_freed_memory()
    return sd


class on_meta(torch.overrides.TorchFunctionMode):
    """Construct modules on the meta device without their random initialisation (the checkpoint
    overwrites every parameter): torch's meta `normal_` / `uniform_` import torch._dynamo, which
    costs an eager process ~150 MB of memory."""
    INIT = {"normal_", "uniform_", "kaiming_uniform_", "trunc_normal_", "xavier_uniform_", "zeros_", "ones_"}

    def __enter__(self):
        self.device = torch.device("meta")
        self.device.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        return self.device.__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) in self.INIT and getattr(func, "__module__", "") == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]
        return func(*args, **(kwargs or {}))


def build_model(args: ModelArgs, hf_tensors: dict, device, dtype: torch.dtype, consume: bool = False) -> Transformer:
    """Construct on the meta device, then assign the (cast) checkpoint tensors; every QWeight becomes a
    QuantizedLinear (a tied quantized head also serves the embedding lookups).  consume=True empties
    `hf_tensors` on the way, so a quantized checkpoint is never held in two layouts at once."""
    with on_meta():
        model = Transformer(args)
    sd = engine_state_dict(args, hf_tensors, consume)
    if args.tie_word_embeddings:
        sd["output.weight"] = sd["tok_embeddings.weight"]
    elif isinstance(sd["tok_embeddings.weight"], QWeight):   # an untied table is only looked up
        sd["tok_embeddings.weight"] = dequantize(sd["tok_embeddings.weight"])
    if isinstance(sd["tok_embeddings.weight"], QWeight):
        del sd["tok_embeddings.weight"]                      # tied: the head's QuantizedLinear serves it
    quantized = [k[:-len(".weight")] for k, v in sd.items() if isinstance(v, QWeight)]
    for name in quantized:
        qw = sd.pop(name + ".weight").map(lambda t: t.to(device))
        bias = sd.pop(name + ".bias", None)
        try:
            layer = QuantizedLinear(qw, None if bias is None else bias.to(device=device, dtype=dtype))
        except ValueError as e:
            raise CheckpointError(f"quantized weight {name}: {e}") from e
        del qw
        release_freed_memory()
        if (layer.out_features, layer.in_features) != tuple(model.get_submodule(name).weight.shape):
            raise CheckpointError(f"quantized weight {name} is {(layer.out_features, layer.in_features)}, the "
                                  f"config needs {tuple(model.get_submodule(name).weight.shape)}")
        model.set_submodule(name, layer)
    sd = {k: v.to(device=device, dtype=dtype) for k, v in sd.items()}
    for name in quantized:
        sd.update({f"{name}.{k}": v for k, v in model.get_submodule(name).state_dict().items()})
    if args.tie_word_embeddings and "output" in quantized:
        model.tok_embeddings = QuantizedEmbedding(model.output, dtype)
    try:
        model.load_state_dict(sd, strict=True, assign=True)
    except RuntimeError as e:
        raise CheckpointError(f"checkpoint does not fit the config: {e}") from e
    if args.tie_word_embeddings and "output" not in quantized:
        model.output.weight = model.tok_embeddings.weight
    if torch.device(device).type == "cpu":
        cpu_kernels_available()                   # build/load now, not inside a torch.compile trace
        use_linear_kernel(model)                  # the C++ decode-sized fp32 linear layers
    model.decode_kernel = decode_attention        # the C++ kernel on CPU (grouped_attention elsewhere)
    model.prefix_kernel = prefix_attention_cpu    # the same for rows reading a shared prefix
    model.use_ops(cpu_eager_ops())                # fewer, larger ops in eager CPU steps
    return model.eval()
