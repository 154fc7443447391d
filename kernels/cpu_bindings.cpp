// Direct Python bindings of the ops an eager decode step calls per layer (kernels/cpu.py `eager_ops()`):
// the same C++ functions as their torch.ops.kvc registrations, called through pybind11 (~0.8 us a call)
// instead of the op dispatcher's Python entry (~2.5-3 us: schema parsing of every argument, boxing).  An
// eager batch-1 step makes ~250 such calls.  torch.compile keeps using torch.ops.kvc (these are opaque to it).
#include <torch/extension.h>

#include <tuple>

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor y, torch::Tensor weight, double eps);
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> rope_split(torch::Tensor qkv, torch::Tensor cos,
                                                                   torch::Tensor sin, int64_t Hq, int64_t Hkv);
torch::Tensor dense_decode(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                           torch::Tensor v_cache, torch::Tensor visible, int64_t start, int64_t Hq, int64_t Hkv,
                           double scale, int64_t lanes);
torch::Tensor silu_mul(torch::Tensor gu);
torch::Tensor qlinear(torch::Tensor x, torch::Tensor w, torch::Tensor scales, torch::Tensor mins, int64_t bits,
                      int64_t group, int64_t isa);
int64_t kivi_arith();
int64_t qlinear_isa();
torch::Tensor qembed(torch::Tensor w, torch::Tensor scales, torch::Tensor mins, int64_t bits, int64_t group,
                     int64_t K, torch::Tensor rows);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm);
  m.def("add_rms_norm", &add_rms_norm);
  m.def("rope_split", &rope_split);
  m.def("dense_decode", &dense_decode);
  m.def("silu_mul", &silu_mul);
  m.def("qlinear", &qlinear);
  m.def("qembed", &qembed);
  m.def("kivi_arith", &kivi_arith);
  m.def("qlinear_isa", &qlinear_isa);
}
