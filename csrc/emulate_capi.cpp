// C entry points of the CPU-emulated kernels (see emulate.h), loaded with ctypes by
// minengine/ops/cuda_emulator.py. Built only there, with -DMINENGINE_EMULATE; not part of _C.
#include <algorithm>
#include <cstring>
#include <exception>

#include "common.cuh"
#include "kernels.h"

namespace {

template <typename F> int guarded(F&& f, char* error, int error_len) {
  try {
    f();
    return 0;
  } catch (const std::exception& e) {
    if (error_len > 0) {
      std::strncpy(error, e.what(), static_cast<size_t>(error_len - 1));
      error[error_len - 1] = '\0';
    }
    return 1;
  }
}

}  // namespace

extern "C" {

int me_paged_attention(const minengine::PagedAttentionArgs* args, char* error, int error_len) {
  return guarded([&] { minengine::paged_attention(*args); }, error, error_len);
}

int me_attention_impl(const minengine::PagedAttentionArgs* args, char* error, int error_len) {
  int impl = -1;
  const int rc = guarded([&] { impl = minengine::attention_impl(*args); }, error, error_len);
  return rc ? -1 : impl;
}

// attention_block_order into out (capacity ints); returns how many it has (-1 on an error).
int64_t me_attention_block_order(const minengine::PagedAttentionArgs* args, int32_t* out, int64_t capacity,
                                 char* error, int error_len) {
  std::vector<int32_t> order;
  if (guarded([&] { order = minengine::attention_block_order(*args); }, error, error_len)) return -1;
  std::copy_n(order.begin(), std::min<int64_t>(capacity, static_cast<int64_t>(order.size())), out);
  return static_cast<int64_t>(order.size());
}

int me_store_kv(const minengine::StoreKVArgs* args, char* error, int error_len) {
  return guarded([&] { minengine::store_kv(*args); }, error, error_len);
}

int me_gather_input_ids(const minengine::GatherArgs* args, char* error, int error_len) {
  return guarded([&] { minengine::gather_input_ids(*args); }, error, error_len);
}

// 1: cp.async copies land when issued; 0: at the wait that covers them (see emulate.h).
void me_set_cp_async_landing(int at_issue) { minengine::emu::land_at_issue() = at_issue != 0; }

// The global memory cp.async may read from now on: n [begin, end) byte ranges (n = 0: unchecked).
void me_set_readable(const uint64_t* ranges, int n) {
  auto& r = minengine::emu::readable();
  r.clear();
  for (int i = 0; i < n; ++i) r.emplace_back(ranges[2 * i], ranges[2 * i + 1]);
}

// q[i] = n[i] / divisor through the kernels' FastDiv (its test: every divisor, any n < 2^31).
int me_fast_div(int64_t divisor, const int32_t* n, int32_t* q, int64_t count, char* error, int error_len) {
  return guarded(
      [&] {
        const minengine::FastDiv div(divisor, "divisor");
        for (int64_t i = 0; i < count; ++i) q[i] = div.div(n[i]);
      },
      error, error_len);
}

}  // extern "C"
