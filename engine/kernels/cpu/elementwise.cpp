// Fused element-wise steps of a decoder layer on the CPU, one pass over the data each instead of
// the four to six torch ops (and as many passes and temporaries) that transformers' modules run:
//
//   rms_norm:     weight * to_dtype(x * rsqrt(mean(x^2) + eps)), the mean in fp32
//   add_rms_norm_: residual = to_dtype(residual + x) in place, then rms_norm(residual)
//   silu_and_mul: to_dtype(to_dtype(silu(gate)) * up), gate and up apart or side by side
//   rotary_:      RoPE in place on the query and key heads of a fused QKV projection:
//                 x * cos + rotate_half(x) * sin, each product rounded as torch rounds it
//
// They round where transformers' bf16 modules round (each op's output is bf16), so in bf16 they
// differ from them only by fp32 summation order and exp's last bits. Rows are split over
// torch's threads.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <cmath>

#include "cpu_vector.h"

namespace {

using namespace prefixgate;

void check_rows(const at::Tensor& tensor, const char* name) {
  TORCH_CHECK(tensor.dim() == 2 && tensor.is_contiguous(), name, " must be a contiguous matrix");
  TORCH_CHECK(tensor.scalar_type() == at::kFloat || tensor.scalar_type() == at::kBFloat16,
              name, " must be fp32 or bf16");
  TORCH_CHECK(tensor.size(1) % kLanes == 0, name, "'s rows must be a multiple of 16 wide");
}

// One row's RMSNorm: target = weight * to_dtype(source * rsqrt(mean(source^2) + eps)).
template <typename scalar_t>
inline void rms_norm_row(const scalar_t* source, const scalar_t* w, int64_t width, float eps,
                         scalar_t* target) {
  vfloat squares = splat(0.0f);
  for (int64_t i = 0; i < width; i += kLanes) {
    const vfloat value = load(source + i);
    squares += value * value;
  }
  const float mean = lanes_sum(squares) / static_cast<float>(width);
  const float scale = 1.0f / std::sqrt(mean + eps);
  for (int64_t i = 0; i < width; i += kLanes) {
    const vfloat normed = round_to(load(source + i) * scale, target);
    store(target + i, load(w + i) * normed);
  }
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
      rms_norm_row(x + row * width, w, width, static_cast<float>(eps), out + row * width);
    }
  });
}

template <typename scalar_t>
void add_rms_norm_rows(const at::Tensor& residual, const at::Tensor& input,
                       const at::Tensor& weight, double eps, const at::Tensor& output) {
  const int64_t rows = input.size(0), width = input.size(1);
  scalar_t* r = residual.data_ptr<scalar_t>();
  const scalar_t* x = input.data_ptr<scalar_t>();
  const scalar_t* w = weight.data_ptr<scalar_t>();
  scalar_t* out = output.data_ptr<scalar_t>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      scalar_t* sum = r + row * width;
      const scalar_t* addend = x + row * width;
      for (int64_t i = 0; i < width; i += kLanes) store(sum + i, load(sum + i) + load(addend + i));
      rms_norm_row(sum, w, width, static_cast<float>(eps), out + row * width);
    }
  });
}

// Rows of `gate` and `up` start `stride` elements apart: separate matrices (stride = width)
// or the halves of one fused gate-and-up product (stride = 2 * width, up = gate + width).
template <typename scalar_t>
void silu_and_mul_rows(const scalar_t* g, const scalar_t* u, int64_t stride, int64_t rows,
                       int64_t width, const at::Tensor& output) {
  scalar_t* out = output.data_ptr<scalar_t>();
  const int64_t per_row = width / kLanes;
  at::parallel_for(0, rows * per_row, 64, [&](int64_t begin, int64_t end) {
    int64_t row = begin / per_row, column = (begin % per_row) * kLanes;  // one division a chunk
    for (int64_t v = begin; v < end; ++v) {
      const vfloat activated = round_to(silu(load(g + row * stride + column)), out);
      store(out + row * width + column, activated * load(u + row * stride + column));
      column += kLanes;
      if (column == width) {
        column = 0;
        ++row;
      }
    }
  });
}

// x * cos + rotate_half(x) * sin for one head, rotate_half(x) = (-x[half:], x[:half]); in bf16
// each product and the sum rounded, as torch's three ops round them (the same bits; in fp32 the
// compiler may fuse a product into the sum). Whole vectors where half the head is a multiple
// of 16 wide, else one element at a time; the vector rounding flushes subnormal products to
// zero where the element-wise one keeps them.
template <typename scalar_t>
inline void rotate_head(scalar_t* x, const scalar_t* cos, const scalar_t* sin, int64_t half) {
  if (half % kLanes == 0) {
    for (int64_t i = 0; i < half; i += kLanes) {
      const vfloat first = load(x + i), second = load(x + i + half);
      const vfloat a = round_to(first * load(cos + i), x);
      const vfloat b = round_to(-second * load(sin + i), x);
      const vfloat c = round_to(second * load(cos + i + half), x);
      const vfloat d = round_to(first * load(sin + i + half), x);
      store(x + i, a + b);
      store(x + i + half, c + d);
    }
    return;
  }
  for (int64_t i = 0; i < half; ++i) {
    const float first = static_cast<float>(x[i]), second = static_cast<float>(x[i + half]);
    const float a = static_cast<float>(static_cast<scalar_t>(first * static_cast<float>(cos[i])));
    const float b = static_cast<float>(static_cast<scalar_t>(-second * static_cast<float>(sin[i])));
    const float c =
        static_cast<float>(static_cast<scalar_t>(second * static_cast<float>(cos[i + half])));
    const float d =
        static_cast<float>(static_cast<scalar_t>(first * static_cast<float>(sin[i + half])));
    x[i] = static_cast<scalar_t>(a + b);
    x[i + half] = static_cast<scalar_t>(c + d);
  }
}

template <typename scalar_t>
void rotary_rows(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                 int64_t heads, int64_t head_dim) {
  const int64_t tokens = qkv.size(0), width = qkv.size(1), half = head_dim / 2;
  scalar_t* x = qkv.data_ptr<scalar_t>();
  const scalar_t* c = cos.data_ptr<scalar_t>();
  const scalar_t* s = sin.data_ptr<scalar_t>();
  at::parallel_for(0, tokens * heads, 64, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t token = item / heads, head = item % heads;
      rotate_head(x + token * width + head * head_dim, c + token * head_dim, s + token * head_dim,
                  half);
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

at::Tensor add_rms_norm_(const at::Tensor& residual, const at::Tensor& input,
                         const at::Tensor& weight, double eps) {
  check_rows(input, "input");
  TORCH_CHECK(residual.sizes() == input.sizes() && residual.is_contiguous() &&
                  residual.scalar_type() == input.scalar_type(),
              "residual must be contiguous and match the input's shape and dtype");
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == input.size(1) &&
                  weight.scalar_type() == input.scalar_type(),
              "weight must be a contiguous vector of the input's width and dtype");
  at::Tensor output = at::empty_like(input);
  AT_DISPATCH_SWITCH(input.scalar_type(), "add_rms_norm_",
    AT_DISPATCH_CASE(at::kFloat, [&] {
      add_rms_norm_rows<scalar_t>(residual, input, weight, eps, output); })
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      add_rms_norm_rows<scalar_t>(residual, input, weight, eps, output); }));
  return output;
}

at::Tensor silu_and_mul(const at::Tensor& gate, const at::Tensor& up) {
  check_rows(gate, "gate");
  TORCH_CHECK(up.sizes() == gate.sizes() && up.is_contiguous() &&
                  up.scalar_type() == gate.scalar_type(),
              "up must be contiguous and match gate's shape and dtype");
  at::Tensor output = at::empty_like(gate);
  const int64_t rows = gate.size(0), width = gate.size(1);
  AT_DISPATCH_SWITCH(gate.scalar_type(), "silu_and_mul",
    AT_DISPATCH_CASE(at::kFloat, [&] {
      silu_and_mul_rows(gate.data_ptr<scalar_t>(), up.data_ptr<scalar_t>(), width, rows, width,
                        output); })
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      silu_and_mul_rows(gate.data_ptr<scalar_t>(), up.data_ptr<scalar_t>(), width, rows, width,
                        output); }));
  return output;
}

// `gate_up` is [rows, 2 * width]: each row's gate, then its up.
at::Tensor gated_silu(const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) % (2 * kLanes) == 0, "gate_up's halves must be a multiple of 16 wide");
  const int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2;
  at::Tensor output = at::empty({rows, width}, gate_up.options());
  AT_DISPATCH_SWITCH(gate_up.scalar_type(), "gated_silu",
    AT_DISPATCH_CASE(at::kFloat, [&] {
      const scalar_t* g = gate_up.data_ptr<scalar_t>();
      silu_and_mul_rows(g, g + width, 2 * width, rows, width, output); })
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      const scalar_t* g = gate_up.data_ptr<scalar_t>();
      silu_and_mul_rows(g, g + width, 2 * width, rows, width, output); }));
  return output;
}

// `qkv` is [tokens, (q_heads + kv_heads + kv_heads) * head_dim]; the first q_heads + kv_heads
// heads (queries and keys) are rotated in place. `cos` and `sin` are [tokens, head_dim].
void rotary_(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
             int64_t head_dim) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous(), "qkv must be a contiguous matrix");
  TORCH_CHECK(qkv.scalar_type() == at::kFloat || qkv.scalar_type() == at::kBFloat16,
              "qkv must be fp32 or bf16");
  TORCH_CHECK(head_dim > 0 && head_dim % 2 == 0 && heads > 0 && heads * head_dim <= qkv.size(1),
              "heads x head_dim must fit in a qkv row, head_dim even");
  for (const at::Tensor* table : {&cos, &sin}) {
    TORCH_CHECK(table->dim() == 2 && table->is_contiguous() && table->size(0) == qkv.size(0) &&
                    table->size(1) == head_dim && table->scalar_type() == qkv.scalar_type(),
                "cos and sin must be contiguous [tokens, head_dim] in qkv's dtype");
  }
  AT_DISPATCH_SWITCH(qkv.scalar_type(), "rotary_",
    AT_DISPATCH_CASE(at::kFloat, [&] { rotary_rows<scalar_t>(qkv, cos, sin, heads, head_dim); })
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      rotary_rows<scalar_t>(qkv, cos, sin, heads, head_dim); }));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(prefixgate, m) {
  m.def("rms_norm(Tensor input, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) residual, Tensor input, Tensor weight, float eps) -> Tensor");
  m.def("silu_and_mul(Tensor gate, Tensor up) -> Tensor");
  m.def("gated_silu(Tensor gate_up) -> Tensor");
  m.def("rotary_(Tensor(a!) qkv, Tensor cos, Tensor sin, int heads, int head_dim) -> ()");
}

TORCH_LIBRARY_IMPL(prefixgate, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm_", &add_rms_norm_);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("gated_silu", &gated_silu);
  m.impl("rotary_", &rotary_);
}
