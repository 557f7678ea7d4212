// store_kv: write this step's K/V rows into the paged caches (contract: triton_kernels/kv_cache.py).
// One block per token; slot s goes to page s / page_size, offset s % page_size; s < 0 is skipped.
#include <cstdint>

#include "common.cuh"
#include "kernels.h"

namespace minengine {

// Each thread copies V-sized pieces of the token's rows: 16 bytes (8 fp16/bf16 or 4 fp32 values)
// where every row start is 16-byte aligned, else single values. On an H100 the value-by-value copy
// took twice Triton's time on a 2111-token batch (11.7 against 5.8 us, the bytes at the copy
// ceiling; ncu: SM 40% busy, DRAM 11%, warps mostly waiting on loads): 2-byte loads and stores,
// 8 times the memory instructions of 16-byte pieces.
template <typename T, typename V>
__global__ void store_kv_kernel(const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ k_cache,
                                T* __restrict__ v_cache, const int64_t* __restrict__ slot_mapping, int num_heads,
                                int head_dim, int page_size, int64_t sk_t, int64_t sk_h, int64_t sv_t, int64_t sv_h,
                                int64_t skc_p, int64_t skc_s, int64_t skc_h, int64_t svc_p, int64_t svc_s,
                                int64_t svc_h) {
  constexpr int kVec = sizeof(V) / sizeof(T);
  const int64_t token = blockIdx.x;
  const int64_t slot = slot_mapping[token];
  if (slot < 0) return;
  const int64_t page = slot / page_size, offset = slot % page_size;
  const int pieces = head_dim / kVec;  // per head
  const T* k_row = k + token * sk_t;
  const T* v_row = v + token * sv_t;
  T* kc_row = k_cache + page * skc_p + offset * skc_s;
  T* vc_row = v_cache + page * svc_p + offset * svc_s;
  for (int i = threadIdx.x; i < num_heads * pieces; i += blockDim.x) {
    const int64_t h = i / pieces, x = static_cast<int64_t>(i % pieces) * kVec;
    copy_global<V>(kc_row + h * skc_h + x, k_row + h * sk_h + x);
    copy_global<V>(vc_row + h * svc_h + x, v_row + h * sv_h + x);
  }
}

// Whether V-sized pieces of n values keep every row start aligned: the pointers on sizeof(V)
// bytes, the head dim and every stride (in values) multiples of n.
template <typename V> static bool vectorizable(const StoreKVArgs& a, int n) {
  for (const uintptr_t p : {a.k, a.v, a.k_cache, a.v_cache}) {
    if (p % sizeof(V) != 0) return false;
  }
  for (const int64_t x : {a.head_dim, a.sk_t, a.sk_h, a.sv_t, a.sv_h, a.skc_p, a.skc_s, a.skc_h, a.svc_p, a.svc_s,
                          a.svc_h}) {
    if (x % n != 0) return false;
  }
  return true;
}

void store_kv(const StoreKVArgs& a) {
  if (a.num_tokens == 0) return;
  dispatch_float(a.dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    auto kernel = vectorizable<uint4>(a, sizeof(uint4) / sizeof(T)) ? store_kv_kernel<T, uint4> : store_kv_kernel<T, T>;
    ME_LAUNCH(kernel, dim3(static_cast<unsigned>(a.num_tokens)), dim3(128), 0, reinterpret_cast<cudaStream_t>(a.stream),
        reinterpret_cast<const T*>(a.k), reinterpret_cast<const T*>(a.v), reinterpret_cast<T*>(a.k_cache),
        reinterpret_cast<T*>(a.v_cache), reinterpret_cast<const int64_t*>(a.slot_mapping), a.num_heads, a.head_dim,
        a.page_size, a.sk_t, a.sk_h, a.sv_t, a.sv_h, a.skc_p, a.skc_s, a.skc_h, a.svc_p, a.svc_s, a.svc_h);
  });
  check_launch("store_kv");
}

}  // namespace minengine
