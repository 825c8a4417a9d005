// Fused element-wise steps of a decoder layer on the CPU, one pass over the data each instead of
// the four to six torch ops (and as many passes and temporaries) that transformers' modules run:
//
//   rms_norm:     weight * to_dtype(x * rsqrt(mean(x^2) + eps)), the mean in fp32
//   silu_and_mul: to_dtype(to_dtype(silu(gate)) * up)
//
// They round where transformers' bf16 modules round (each op's output is bf16), so in bf16 they
// differ from them only by fp32 summation order and exp's last bits. Rows are split over
// torch's threads.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <cmath>

#include "cpu_vector.h"

namespace {

using namespace prefixgate;

// The value as the dtype would hold it: bf16 rounds (to nearest even), fp32 stays.
inline vfloat round_to(vfloat value, float*) { return value; }
inline vfloat round_to(vfloat value, c10::BFloat16*) {
  uint16_t bits[kLanes];
  store_bf16(bits, value);
  return load(reinterpret_cast<const c10::BFloat16*>(bits));
}

void check_rows(const at::Tensor& tensor, const char* name) {
  TORCH_CHECK(tensor.dim() == 2 && tensor.is_contiguous(), name, " must be a contiguous matrix");
  TORCH_CHECK(tensor.scalar_type() == at::kFloat || tensor.scalar_type() == at::kBFloat16,
              name, " must be fp32 or bf16");
  TORCH_CHECK(tensor.size(1) % kLanes == 0, name, "'s rows must be a multiple of 16 wide");
}

template <typename scalar_t>
void rms_norm_rows(const at::Tensor& input, const at::Tensor& weight, double eps,
                   const at::Tensor& output) {
  const int64_t rows = input.size(0), width = input.size(1);
  const scalar_t* x = input.data_ptr<scalar_t>();
  const scalar_t* w = weight.data_ptr<scalar_t>();
  scalar_t* out = output.data_ptr<scalar_t>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const scalar_t* source = x + row * width;
      vfloat squares = splat(0.0f);
      for (int64_t i = 0; i < width; i += kLanes) {
        const vfloat value = load(source + i);
        squares += value * value;
      }
      const float mean = lanes_sum(squares) / static_cast<float>(width);
      const float scale = 1.0f / std::sqrt(mean + static_cast<float>(eps));
      scalar_t* target = out + row * width;
      for (int64_t i = 0; i < width; i += kLanes) {
        const vfloat normed = round_to(load(source + i) * scale, target);
        store(target + i, load(w + i) * normed);
      }
    }
  });
}

template <typename scalar_t>
void silu_and_mul_rows(const at::Tensor& gate, const at::Tensor& up, const at::Tensor& output) {
  const int64_t rows = gate.size(0), width = gate.size(1);
  const scalar_t* g = gate.data_ptr<scalar_t>();
  const scalar_t* u = up.data_ptr<scalar_t>();
  scalar_t* out = output.data_ptr<scalar_t>();
  at::parallel_for(0, rows * width / kLanes, 64, [&](int64_t begin, int64_t end) {
    for (int64_t v = begin; v < end; ++v) {
      const int64_t i = v * kLanes;
      const vfloat x = load(g + i);
      // silu(x) = x * sigmoid(x), from e = exp(-|x|) <= 1 so that exp never overflows.
      const vfloat magnitude = x < 0.0f ? -x : x;
      const vfloat e = vexp(-magnitude);
      const vfloat sigmoid = x < 0.0f ? e / (1.0f + e) : 1.0f / (1.0f + e);
      const vfloat activated = round_to(x * sigmoid, out);
      store(out + i, activated * load(u + i));
    }
  });
}

at::Tensor rms_norm(const at::Tensor& input, const at::Tensor& weight, double eps) {
  check_rows(input, "input");
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == input.size(1) &&
                  weight.scalar_type() == input.scalar_type(),
              "weight must be a contiguous vector of the input's width and dtype");
  at::Tensor output = at::empty_like(input);
  AT_DISPATCH_SWITCH(input.scalar_type(), "rms_norm",
    AT_DISPATCH_CASE(at::kFloat, [&] { rms_norm_rows<scalar_t>(input, weight, eps, output); })
    AT_DISPATCH_CASE(at::kBFloat16, [&] { rms_norm_rows<scalar_t>(input, weight, eps, output); }));
  return output;
}

at::Tensor silu_and_mul(const at::Tensor& gate, const at::Tensor& up) {
  check_rows(gate, "gate");
  TORCH_CHECK(up.sizes() == gate.sizes() && up.is_contiguous() &&
                  up.scalar_type() == gate.scalar_type(),
              "up must be contiguous and match gate's shape and dtype");
  at::Tensor output = at::empty_like(gate);
  AT_DISPATCH_SWITCH(gate.scalar_type(), "silu_and_mul",
    AT_DISPATCH_CASE(at::kFloat, [&] { silu_and_mul_rows<scalar_t>(gate, up, output); })
    AT_DISPATCH_CASE(at::kBFloat16, [&] { silu_and_mul_rows<scalar_t>(gate, up, output); }));
  return output;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(prefixgate, m) {
  m.def("rms_norm(Tensor input, Tensor weight, float eps) -> Tensor");
  m.def("silu_and_mul(Tensor gate, Tensor up) -> Tensor");
}

TORCH_LIBRARY_IMPL(prefixgate, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
}
