// The label cache's decode ops of Double Sparsity and HShare (cache/labels.py), built with
// kernels/cpu_kernels.cpp by kernels/cpu.py.  Labels are the C heavy channels of each cached key: fp32
// [B, H, S, C], or 4-bit packed [B, H, S, C/2] uint8 (byte j = code 2j | code 2j+1 << 4) with a per-token
// fp16 scale and minimum [B, H, S] (label ~= code * scale + minimum).
//
//   kvc::label_scores(q_label [B, Hq, C] fp32, labels [B, H, S, C or C/2], scale, minimum [B, H, S] fp16 (or
//                     empty tensors for fp32 labels), group_sum) -> fp32 [B, H, S] (group_sum: the G = Hq / H
//                     query heads of each KV head summed before the dot, as approx_scores(group="kv")) or
//                     [B, Hq, S] (group="query")
//       == kernels.approx_scores_torch to float rounding.  Packed: per output row, C/2 tables of the 256
//       byte values' partial dots (q[2j] lo + q[2j+1] hi) turn a token's dot into C/2 lookups; then
//       scale * dot + minimum * sum(q).  The strides of labels/scale/minimum are taken as they are (a
//       slice of the first heads or slots needs no copy); each label's channels are contiguous.
//   kvc::label_write(k [B, H, 1, D] fp32, channels [H, C] long, labels, scale, minimum (as above), slots
//                    [B, H] long or empty, slot) -> ()
//       the decode token's label (k at each head's heavy channels) stored at slots[b, h] (or at `slot` for
//       every row and head when slots is empty); 4-bit labels quantized exactly as
//       kernels.quantize_labels_4bit: the minimum rounded down and the scale up to fp16, codes rounded half
//       to even and clamped to [0, 15], bit for bit.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>
#include <vector>

// packed labels' fp16 scale and minimum: [B, H, S] like the labels, both of one layout
static void check_label_params(const torch::Tensor& labels, const torch::Tensor& scale, const torch::Tensor& minimum,
                               const char* op) {
  TORCH_CHECK(scale.dtype() == torch::kHalf && minimum.dtype() == torch::kHalf
              && scale.sizes() == labels.sizes().slice(0, 3) && minimum.sizes() == scale.sizes()
              && scale.strides() == minimum.strides(),
              op, ": packed labels need fp16 scale/minimum [B, H, S] of one layout");
}

static float half_to_float(const at::Half* p, int64_t i) { return static_cast<float>(p[i]); }

// Scores of one output row over S labels.  q: the row's C query channels; qsum: their sum.
static void packed_row(const float* q, int64_t C, const uint8_t* lab, int64_t ls, const at::Half* sc,
                       const at::Half* mn, int64_t ps, int64_t S, float* out, std::vector<float>& lut) {
  const int64_t Cb = C / 2;
  lut.resize(Cb * 256);
  float qsum = 0.f;
  for (int64_t c = 0; c < C; ++c) qsum += q[c];
  for (int64_t j = 0; j < Cb; ++j)
    for (int u = 0; u < 256; ++u) lut[j * 256 + u] = q[2 * j] * (float)(u & 15) + q[2 * j + 1] * (float)(u >> 4);
  const float* t = lut.data();
  if (Cb == 4) {                                   // head_dim 64, C = D / 8: one 32-bit word per label
    for (int64_t s = 0; s < S; ++s) {
      const uint8_t* l = lab + s * ls;
      const float dot = (t[l[0]] + t[256 + l[1]]) + (t[512 + l[2]] + t[768 + l[3]]);
      out[s] = half_to_float(sc, s * ps) * dot + half_to_float(mn, s * ps) * qsum;
    }
    return;
  }
  for (int64_t s = 0; s < S; ++s) {
    const uint8_t* l = lab + s * ls;
    float dot = 0.f;
    for (int64_t j = 0; j < Cb; ++j) dot += t[j * 256 + l[j]];
    out[s] = half_to_float(sc, s * ps) * dot + half_to_float(mn, s * ps) * qsum;
  }
}

static void float_row(const float* q, int64_t C, const float* lab, int64_t ls, int64_t S, float* out) {
  for (int64_t s = 0; s < S; ++s) {
    const float* l = lab + s * ls;
    float dot = 0.f;
    for (int64_t c = 0; c < C; ++c) dot += q[c] * l[c];
    out[s] = dot;
  }
}

torch::Tensor label_scores(torch::Tensor q_label, torch::Tensor labels, torch::Tensor scale, torch::Tensor minimum,
                           bool group_sum) {
  TORCH_CHECK(q_label.dim() == 3 && q_label.dtype() == torch::kFloat,
              "kvc::label_scores: q_label must be fp32 [B, Hq, C]");
  TORCH_CHECK(labels.dim() == 4 && labels.stride(3) == 1,
              "kvc::label_scores: labels [B, H, S, C] with contiguous channels");
  const bool packed = labels.dtype() == torch::kByte;
  TORCH_CHECK(packed || labels.dtype() == torch::kFloat, "kvc::label_scores: labels must be fp32 or packed uint8");
  auto q = q_label.contiguous();
  const int64_t B = q.size(0), Hq = q.size(1), C = q.size(2), H = labels.size(1), S = labels.size(2);
  TORCH_CHECK(labels.size(0) == B && Hq % H == 0, "kvc::label_scores: batch or head counts do not match");
  TORCH_CHECK(labels.size(3) == (packed ? C / 2 : C) && (!packed || C % 2 == 0), "kvc::label_scores: channel count");
  if (packed) check_label_params(labels, scale, minimum, "kvc::label_scores");
  const int64_t G = Hq / H, Hout = group_sum ? H : Hq;
  auto out = torch::empty({B, Hout, S}, q.options());
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, B * Hout, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qrow(C), lut;
    for (int64_t r = begin; r < end; ++r) {
      const int64_t b = r / Hout, ho = r % Hout, h = group_sum ? ho : ho / G;
      const float* qb = qp + (b * Hq + (group_sum ? h * G : ho)) * C;
      for (int64_t c = 0; c < C; ++c) {
        float acc = 0.f;
        for (int64_t g = 0; g < (group_sum ? G : 1); ++g) acc += qb[g * C + c];
        qrow[c] = acc;
      }
      float* o = op + r * S;
      if (packed) {
        const uint8_t* lab = labels.data_ptr<uint8_t>() + b * labels.stride(0) + h * labels.stride(1);
        const int64_t po = b * scale.stride(0) + h * scale.stride(1);
        packed_row(qrow.data(), C, lab, labels.stride(2), scale.data_ptr<at::Half>() + po,
                   minimum.data_ptr<at::Half>() + po, scale.stride(2), S, o, lut);
      } else {
        const float* lab = labels.data_ptr<float>() + b * labels.stride(0) + h * labels.stride(1);
        float_row(qrow.data(), C, lab, labels.stride(2), S, o);
      }
    }
  });
  return out;
}

// fp16 one step towards -inf (down) or +inf (up), as torch.nextafter on fp16 (finite inputs)
static at::Half half_step(at::Half x, bool up) {
  uint16_t u;
  std::memcpy(&u, &x, 2);
  const bool neg = u & 0x8000u, zero = (u & 0x7FFFu) == 0;
  if (zero) u = up ? 0x0001u : 0x8001u;
  else u = (neg != up) ? u + 1 : u - 1;                      // away from zero: +1 on the magnitude
  at::Half y;
  std::memcpy(&y, &u, 2);
  return y;
}

// One label of C fp32 channels -> packed codes, fp16 scale and minimum (quantize_labels_4bit's arithmetic)
static void quantize_label(const float* x, int64_t C, uint8_t* packed, at::Half* sc_out, at::Half* mn_out) {
  float lo = x[0], hi = x[0];
  for (int64_t c = 1; c < C; ++c) { lo = std::min(lo, x[c]); hi = std::max(hi, x[c]); }
  at::Half mn(lo);
  if (static_cast<float>(mn) > lo) mn = half_step(mn, false);
  const float mnf = static_cast<float>(mn);
  at::Half sc((hi - mnf) / 15.f);
  volatile float top = 15.f * static_cast<float>(sc);        // volatile: no fused multiply-add (torch rounds twice)
  if (mnf + top < hi) sc = half_step(sc, true);
  const float scf = static_cast<float>(sc);
  for (int64_t j = 0; j < C / 2; ++j) {
    uint8_t code[2];
    for (int i = 0; i < 2; ++i) {
      const float q = scf > 0.f ? (x[2 * j + i] - mnf) / scf : 0.f;
      code[i] = (uint8_t)std::min(15.f, std::max(0.f, std::nearbyint(q)));
    }
    packed[j] = code[0] | (code[1] << 4);
  }
  *sc_out = sc;
  *mn_out = mn;
}

void label_write(torch::Tensor k, torch::Tensor channels, torch::Tensor labels, torch::Tensor scale,
                 torch::Tensor minimum, torch::Tensor slots, int64_t slot) {
  TORCH_CHECK(k.dim() == 4 && k.size(2) == 1 && k.dtype() == torch::kFloat,
              "kvc::label_write: k must be fp32 [B, H, 1, D]");
  TORCH_CHECK(channels.dim() == 2 && channels.dtype() == torch::kLong,
              "kvc::label_write: channels must be long [H, C]");
  const int64_t B = k.size(0), H = k.size(1), D = k.size(3), C = channels.size(1);
  const bool packed = labels.dtype() == torch::kByte;
  TORCH_CHECK(packed || labels.dtype() == torch::kFloat, "kvc::label_write: labels must be fp32 or packed uint8");
  TORCH_CHECK(labels.dim() == 4 && labels.size(0) == B && labels.size(1) == H && labels.stride(3) == 1
              && labels.size(3) == (packed ? C / 2 : C) && channels.size(0) == H, "kvc::label_write: label shapes");
  if (packed) check_label_params(labels, scale, minimum, "kvc::label_write");
  const bool per_row = slots.numel() > 0;
  TORCH_CHECK(!per_row || (slots.dtype() == torch::kLong && slots.sizes() == torch::IntArrayRef({B, H})),
              "kvc::label_write: slots must be long [B, H] (or empty: `slot` for all)");
  auto kc = k.contiguous();
  auto ch = channels.contiguous();
  auto sl = per_row ? slots.contiguous() : slots;
  const float* kp = kc.data_ptr<float>();
  const int64_t* cp = ch.data_ptr<int64_t>();
  for (int64_t i = 0; i < H * C; ++i) TORCH_CHECK(cp[i] >= 0 && cp[i] < D, "kvc::label_write: channel out of range");
  std::vector<float> x(C);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      const int64_t s = per_row ? sl.data_ptr<int64_t>()[b * H + h] : slot;
      TORCH_CHECK(s >= 0 && s < labels.size(2), "kvc::label_write: slot out of range");
      const float* kr = kp + (b * H + h) * D;
      for (int64_t c = 0; c < C; ++c) x[c] = kr[cp[h * C + c]];
      if (packed) {
        uint8_t* dst = labels.data_ptr<uint8_t>() + b * labels.stride(0) + h * labels.stride(1) + s * labels.stride(2);
        const int64_t po = b * scale.stride(0) + h * scale.stride(1) + s * scale.stride(2);
        quantize_label(x.data(), C, dst, scale.data_ptr<at::Half>() + po, minimum.data_ptr<at::Half>() + po);
      } else {
        float* dst = labels.data_ptr<float>() + b * labels.stride(0) + h * labels.stride(1) + s * labels.stride(2);
        std::memcpy(dst, x.data(), C * sizeof(float));
      }
    }
  }
}

TORCH_LIBRARY_FRAGMENT(kvc, m) {
  m.def("label_scores(Tensor q_label, Tensor labels, Tensor scale, Tensor minimum, bool group_sum) -> Tensor");
  m.def("label_write(Tensor k, Tensor channels, Tensor(a!) labels, Tensor(b!) scale, Tensor(c!) minimum, "
        "Tensor slots, SymInt slot) -> ()");
}

TORCH_LIBRARY_IMPL(kvc, CPU, m) {
  m.impl("label_scores", &label_scores);
  m.impl("label_write", &label_write);
}
