"""Reading checkpoints into `model.Transformer`: HuggingFace directories, GGUF files, and the
engine's converted directories (which are HuggingFace directories: config.json + safetensors +
tokenizer files, so transformers can load them too).

All routes produce a HuggingFace-named state dict in rotate-half q/k layout, which
`engine_state_dict` renames and fuses (q|k|v, gate|up) for `model.py`.  A linear weight in it is a
float tensor or, for quantized checkpoints, a `kernels.qlinear.QWeight` (int8/int4 codes + fp16
scales): directories written by `python quantize.py` (config "quantization_config") and, with
weights="auto", the Q8_0 / Q4_0 / Q4_1 tensors of a GGUF file, repacked code for code (the
scales are the file's fp16 values; nothing is rounded again).  `build_model` swaps a
`QuantizedLinear` in for each of them.

One module per idea; imports go one way (down), none between the two readers:

    read.py           path -> reader, validate_checkpoint, read_checkpoint (tokenizer, finite weights)
      |-> hf_dir.py          safetensors headers and tensors, HF directories; write_converted_dir
      |     '-> quantized_dir.py   quantize.py's scheme, X.qweight/X.scales[/X.mins] <-> QWeight
      '-> gguf_file.py       scan_gguf, inspect_gguf, read_gguf, GGUF block repacking (gguf_qweight)
    build.py          HF names -> fused model.py names, on_meta, build_model (kernels plugged in)
    check.py          CheckpointError; the tensors a config describes (check_config), finite RoPE
    memory.py         release_freed_memory

Every module above uses check.py; gguf_file.py and build.py use memory.py.  This file only
re-exports the names callers use (`from checkpoint import read_checkpoint`).
"""
from checkpoint.build import build_model, cat_rows, engine_state_dict, on_meta
from checkpoint.check import CheckpointError, check_config, expected_shapes
from checkpoint.gguf_file import (args_from_gguf, dequantize_gguf_tensor, gguf_qweight, inspect_gguf,
                                  read_gguf, scan_gguf)
from checkpoint.hf_dir import (inspect_hf_dir, read_hf_dir, read_safetensors, safetensors_header,
                               write_converted_dir)
from checkpoint.memory import release_freed_memory
from checkpoint.quantized_dir import (QUANT_METHOD, collect_qweights, flatten_qweights, linear_weight_names,
                                      read_quantization)
from checkpoint.read import WEIGHTS, check_finite, read_checkpoint, validate_checkpoint

__all__ = ["QUANT_METHOD", "WEIGHTS", "CheckpointError", "args_from_gguf", "build_model", "cat_rows",
           "check_config", "check_finite", "collect_qweights", "dequantize_gguf_tensor", "engine_state_dict",
           "expected_shapes", "flatten_qweights", "gguf_qweight", "inspect_gguf", "inspect_hf_dir",
           "linear_weight_names", "on_meta", "read_checkpoint", "read_gguf", "read_hf_dir", "read_quantization",
           "read_safetensors", "release_freed_memory", "safetensors_header", "scan_gguf", "validate_checkpoint",
           "write_converted_dir"]
