// store_kv: write this step's K/V rows into the paged caches (contract: triton_kernels/kv_cache.py).
// One block per token; slot s goes to page s / page_size, offset s % page_size; s < 0 is skipped.
#include "common.cuh"
#include "kernels.h"

namespace minengine {

template <typename T>
__global__ void store_kv_kernel(const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ k_cache,
                                T* __restrict__ v_cache, const int64_t* __restrict__ slot_mapping, int num_heads,
                                int head_dim, int page_size, int64_t sk_t, int64_t sk_h, int64_t sv_t, int64_t sv_h,
                                int64_t skc_p, int64_t skc_s, int64_t skc_h, int64_t svc_p, int64_t svc_s,
                                int64_t svc_h) {
  const int64_t token = blockIdx.x;
  const int64_t slot = slot_mapping[token];
  if (slot < 0) return;
  const int64_t page = slot / page_size, offset = slot % page_size;
  for (int i = threadIdx.x; i < num_heads * head_dim; i += blockDim.x) {
    const int h = i / head_dim, x = i % head_dim;
    k_cache[page * skc_p + offset * skc_s + h * skc_h + x] = k[token * sk_t + h * sk_h + x];
    v_cache[page * svc_p + offset * svc_s + h * svc_h + x] = v[token * sv_t + h * sv_h + x];
  }
}

void store_kv(const StoreKVArgs& a) {
  if (a.num_tokens == 0) return;
  dispatch_float(a.dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    auto kernel = store_kv_kernel<T>;
    ME_LAUNCH(kernel, dim3(static_cast<unsigned>(a.num_tokens)), dim3(128), 0, reinterpret_cast<cudaStream_t>(a.stream),
        reinterpret_cast<const T*>(a.k), reinterpret_cast<const T*>(a.v), reinterpret_cast<T*>(a.k_cache),
        reinterpret_cast<T*>(a.v_cache), reinterpret_cast<const int64_t*>(a.slot_mapping), a.num_heads, a.head_dim,
        a.page_size, a.sk_t, a.sk_h, a.sv_t, a.sv_h, a.skc_p, a.skc_s, a.skc_h, a.svc_p, a.svc_s, a.svc_h);
  });
  check_launch("store_kv");
}

}  // namespace minengine
