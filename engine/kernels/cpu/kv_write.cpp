// A step's new K and V rows into their slots of a layer's paged pool, one call for the whole
// batch: each token's heads are copied as they lie, over torch's threads.
//
// torch's `index_copy_` does the same through its strided iterator, two calls a layer; this
// one call measured faster in decode steps, and the same in prefill (its rows land in pool
// memory no cache holds yet).
//
// Every slot is checked against the pool before anything is written: a bad slot is an error,
// and nothing of the call lands. The slots of one call are distinct (the engine gives each
// token of a step its own slot); two equal ones would race (`index_copy_` leaves their order
// unspecified too).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

namespace prefixgate {
namespace {

// key_cache, value_cache: [blocks, block_size, kv_heads, dim], contiguous. key, value:
// [tokens, kv_heads, dim] of the same dtype, each head's dim contiguous (any token and head
// strides). slots: int64 [tokens], slot = block * block_size + offset in the block.
void write_kv(const at::Tensor& key_cache, const at::Tensor& value_cache, const at::Tensor& key,
              const at::Tensor& value, const at::Tensor& slots) {
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous() &&
                  value_cache.sizes() == key_cache.sizes() && value_cache.is_contiguous() &&
                  value_cache.scalar_type() == key_cache.scalar_type(),
              "the caches must be contiguous [blocks, block_size, kv_heads, dim] of one dtype");
  const int64_t heads = key_cache.size(2), dim = key_cache.size(3);
  for (const at::Tensor* rows : {&key, &value}) {
    TORCH_CHECK(rows->dim() == 3 && rows->size(1) == heads && rows->size(2) == dim &&
                    rows->stride(2) == 1 && rows->scalar_type() == key_cache.scalar_type(),
                "key and value must be [tokens, kv_heads, dim] in the caches' dtype, dim "
                "contiguous");
  }
  TORCH_CHECK(value.size(0) == key.size(0), "key and value must have one row per token");
  TORCH_CHECK(slots.dim() == 1 && slots.is_contiguous() && slots.scalar_type() == at::kLong &&
                  slots.size(0) == key.size(0),
              "slots must be one contiguous int64 per token");
  const int64_t tokens = key.size(0), capacity = key_cache.size(0) * key_cache.size(1);
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(slot[t] >= 0 && slot[t] < capacity, "slot ", slot[t], " is outside the pool");
  }
  const int64_t element = key_cache.element_size(), row_bytes = dim * element;
  char* caches[2] = {static_cast<char*>(key_cache.data_ptr()),
                     static_cast<char*>(value_cache.data_ptr())};
  const char* sources[2] = {static_cast<const char*>(key.data_ptr()),
                            static_cast<const char*>(value.data_ptr())};
  const int64_t token_strides[2] = {key.stride(0) * element, value.stride(0) * element};
  const int64_t head_strides[2] = {key.stride(1) * element, value.stride(1) * element};
  at::parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int kv = 0; kv < 2; ++kv) {
        char* target = caches[kv] + slot[t] * heads * row_bytes;
        const char* source = sources[kv] + t * token_strides[kv];
        if (head_strides[kv] == row_bytes) {  // the token's heads side by side: one copy
          std::memcpy(target, source, heads * row_bytes);
          continue;
        }
        for (int64_t h = 0; h < heads; ++h) {
          std::memcpy(target + h * row_bytes, source + h * head_strides[kv], row_bytes);
        }
      }
    }
  });
}

}  // namespace
}  // namespace prefixgate

TORCH_LIBRARY_FRAGMENT(prefixgate, m) {
  m.def(
      "write_kv(Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor key, Tensor value, "
      "Tensor slots) -> ()");
}

TORCH_LIBRARY_IMPL(prefixgate, CPU, m) { m.impl("write_kv", &prefixgate::write_kv); }
