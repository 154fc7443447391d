"""Which implementation a kernels/ dispatcher runs: `backend="auto" | "triton" | "torch" | "cpp"`.

"auto" runs Triton when the tensors live on CUDA (and Triton imports), the torch twin otherwise.
"triton" on CPU tensors needs the Triton interpreter: TRITON_INTERPRET=1 must be in the environment
before the first Triton call (the kernels are built lazily, on first use, so importing kernels/ never
imports Triton).  "cpp" (the C++ CPU kernels, kernels/cpu.py) resolves to "torch" here: the dispatchers
that have a C++ kernel check for it first (`cpu.use_cpu_kernel`), the others run their twin.

KVC_KIVI_ARITH (KIVI's dense reads of 2/4-bit storage) and KVC_QLINEAR_ARITH (the instructions of the
quantized layers' one arithmetic; it refuses "fp32") ask for an arithmetic: "auto", "int", "fp32", or a CPU
ISA "avx2" / "vnni", parsed by
`arith_request`; kernels/cpu.py resolves them for the C++ ops, kernels/kivi_int_triton.py
KVC_KIVI_ARITH for the Triton kernels.
"""
import os

import torch

BACKENDS = ("auto", "triton", "torch", "cpp")


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except ImportError:
        return False
    return True


ARITHS = ("auto", "int", "fp32", "avx2", "vnni")      # what the KVC_*_ARITH variables may ask for


def arith_request(var: str) -> str:
    """The arithmetic environment variable `var` (KVC_KIVI_ARITH, KVC_QLINEAR_ARITH) as asked (default
    "auto"), ValueError for anything not in ARITHS."""
    want = os.environ.get(var, "auto")
    if want not in ARITHS:
        raise ValueError(f"{var} must be {', '.join(ARITHS)}; got {want!r}")
    return want


def kivi_arith_request() -> str:
    """KVC_KIVI_ARITH as asked (arith_request)."""
    return arith_request("KVC_KIVI_ARITH")


def resolve_backend(backend: str, *tensors: torch.Tensor) -> str:
    """"triton" or "torch" for a call on `tensors` (shape/device checks only, never a host sync)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    on_cuda = all(t.is_cuda for t in tensors if t is not None)
    if backend in ("torch", "cpp"):
        return "torch"
    if backend == "auto":
        return "triton" if on_cuda and triton_available() else "torch"
    if not triton_available():
        raise RuntimeError("backend='triton' but triton is not installed")
    if not on_cuda and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise RuntimeError("backend='triton' on CPU tensors needs TRITON_INTERPRET=1 in the environment "
                           "before the first Triton call")
    return "triton"
