// gather_input_ids: out[:P] = prefill_ids, out[P:] = token_buffer[decode_indices], one launch
// (contract: triton_kernels/input_ids.py). prefill_ids may live in pinned host memory: with
// unified addressing the kernel reads it directly, fusing the host-to-device copy into the gather.
#include "common.cuh"
#include "kernels.h"

namespace minengine {

template <typename T, typename I>
__global__ void gather_kernel(const T* __restrict__ prefill, const T* __restrict__ buffer,
                              const I* __restrict__ indices, T* __restrict__ out, int64_t num_prefill, int64_t total,
                              int64_t sp, int64_t sb, int64_t si, int64_t so) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= total) return;
  out[i * so] = i < num_prefill ? prefill[i * sp] : buffer[static_cast<int64_t>(indices[(i - num_prefill) * si]) * sb];
}

void gather_input_ids(const GatherArgs& a) {
  const int64_t total = a.num_prefill + a.num_decode;
  if (total == 0) return;
  const int threads = 256;
  const unsigned blocks = static_cast<unsigned>((total + threads - 1) / threads);
  auto stream = reinterpret_cast<cudaStream_t>(a.stream);
  auto launch = [&](auto* id_tag, auto* index_tag) {
    using T = std::remove_pointer_t<decltype(id_tag)>;
    using I = std::remove_pointer_t<decltype(index_tag)>;
    auto kernel = gather_kernel<T, I>;
    ME_LAUNCH(kernel, dim3(blocks), dim3(threads), 0, stream,
        reinterpret_cast<const T*>(a.prefill_ids), reinterpret_cast<const T*>(a.token_buffer),
        reinterpret_cast<const I*>(a.decode_indices), reinterpret_cast<T*>(a.out), a.num_prefill, total, a.sp, a.sb,
        a.si, a.so);
  };
  dispatch_index(a.id_dtype, [&](auto* id_tag) { dispatch_index(a.index_dtype, [&](auto* ix) { launch(id_tag, ix); }); });
  check_launch("gather_input_ids");
}

}  // namespace minengine
