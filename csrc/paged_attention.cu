// paged_attention on CUDA cores (contract: triton_kernels/attention.py).
//
// One block per (query token, query head), 4 warps. The block finds its sequence by binary search
// over cu_seqlens_q (tokens past the last sequence are padding and get zeros), then the warps split
// the visible keys 0..pos: each warp walks every 4th key, its 32 lanes split the head dim
// (coalesced reads of a K/V row), and keeps an online softmax (max, sum, acc). The warps' partial
// results are merged through shared memory. Keys at or past seq_len and block-table entries past
// the last page are never read; offsets are 64-bit. Accumulation is fp32.
//
// This is the correct-by-construction baseline of the CUDA backend; the tensor-core (mma.sync /
// wgmma) tiles with split-KV and prefill/decode co-scheduling are still to come.
#include <cmath>

#include "common.cuh"
#include "kernels.h"

namespace minengine {

constexpr int kWarps = 4;
constexpr int kMaxHeadDim = 256;
constexpr int kPerLane = kMaxHeadDim / 32;

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

template <typename T>
__global__ void __launch_bounds__(kWarps * 32)
    paged_attention_kernel(const T* __restrict__ q, const T* __restrict__ k_cache, const T* __restrict__ v_cache,
                           T* __restrict__ out, const int32_t* __restrict__ block_tables,
                           const int32_t* __restrict__ seq_lens, const int32_t* __restrict__ cu_seqlens_q,
                           int num_seqs, int group, int head_dim, int page_size, int64_t sq_t, int64_t sq_h,
                           int64_t sk_p, int64_t sk_s, int64_t sk_h, int64_t sv_p, int64_t sv_s, int64_t sv_h,
                           int64_t so_t, int64_t so_h, int64_t sbt, float scale) {
  const int token = blockIdx.x, head = blockIdx.y, kv_head = head / group;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __shared__ int s_seq;
  __shared__ float s_max[kWarps], s_sum[kWarps];
  __shared__ float s_acc[kWarps][kMaxHeadDim];

  if (threadIdx.x == 0) {  // the last b with cu[b] <= token; b == num_seqs: padding
    int lo = 0, hi = num_seqs;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (cu_seqlens_q[mid] <= token) lo = mid; else hi = mid - 1;
    }
    s_seq = lo;
  }
  __syncthreads();
  const int seq = s_seq;
  T* o = out + static_cast<int64_t>(token) * so_t + static_cast<int64_t>(head) * so_h;
  if (seq >= num_seqs) {
    for (int x = threadIdx.x; x < head_dim; x += blockDim.x) o[x] = from_float<T>(0.f);
    return;
  }
  const int q_start = cu_seqlens_q[seq], q_end = cu_seqlens_q[seq + 1];
  const int seq_len = seq_lens[seq];
  const int kv_end = seq_len - (q_end - q_start) + (token - q_start) + 1;  // keys 0..position

  const T* qp = q + static_cast<int64_t>(token) * sq_t + static_cast<int64_t>(head) * sq_h;
  float qr[kPerLane], acc[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int x = lane + 32 * i;
    qr[i] = x < head_dim ? to_float(qp[x]) * scale : 0.f;
    acc[i] = 0.f;
  }
  float m = -INFINITY, l = 0.f;
  const int32_t* table = block_tables + static_cast<int64_t>(seq) * sbt;
  for (int j = warp; j < kv_end; j += kWarps) {
    const int64_t page = table[j / page_size];
    const int64_t slot = j % page_size;
    const T* kp = k_cache + page * sk_p + slot * sk_s + static_cast<int64_t>(kv_head) * sk_h;
    const T* vp = v_cache + page * sv_p + slot * sv_s + static_cast<int64_t>(kv_head) * sv_h;
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int x = lane + 32 * i;
      if (x < head_dim) s += qr[i] * to_float(kp[x]);
    }
    s = warp_sum(s);
    const float m_new = fmaxf(m, s);
    const float alpha = expf(m - m_new), p = expf(s - m_new);
    l = l * alpha + p;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int x = lane + 32 * i;
      if (x < head_dim) acc[i] = acc[i] * alpha + p * to_float(vp[x]);
    }
    m = m_new;
  }

  if (lane == 0) {
    s_max[warp] = m;
    s_sum[warp] = l;
  }
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int x = lane + 32 * i;
    if (x < head_dim) s_acc[warp][x] = acc[i];
  }
  __syncthreads();
  float m_all = -INFINITY;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) m_all = fmaxf(m_all, s_max[w]);
  for (int x = threadIdx.x; x < head_dim; x += blockDim.x) {
    float total = 0.f, value = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float weight = s_max[w] == -INFINITY ? 0.f : expf(s_max[w] - m_all);
      total += weight * s_sum[w];
      value += weight * s_acc[w][x];
    }
    o[x] = from_float<T>(total > 0.f ? value / total : 0.f);
  }
}

void paged_attention(const PagedAttentionArgs& a) {
  if (a.num_tokens == 0) return;
  if (a.head_dim > kMaxHeadDim) throw std::invalid_argument("head_dim above 256");
  const dim3 grid(static_cast<unsigned>(a.num_tokens), static_cast<unsigned>(a.num_q_heads));
  const int group = static_cast<int>(a.num_q_heads / a.num_kv_heads);
  dispatch_float(a.dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    paged_attention_kernel<T><<<grid, kWarps * 32, 0, reinterpret_cast<cudaStream_t>(a.stream)>>>(
        reinterpret_cast<const T*>(a.q), reinterpret_cast<const T*>(a.k_cache), reinterpret_cast<const T*>(a.v_cache),
        reinterpret_cast<T*>(a.out), reinterpret_cast<const int32_t*>(a.block_tables),
        reinterpret_cast<const int32_t*>(a.seq_lens), reinterpret_cast<const int32_t*>(a.cu_seqlens_q),
        static_cast<int>(a.num_seqs), group, static_cast<int>(a.head_dim), static_cast<int>(a.page_size), a.sq_t,
        a.sq_h, a.sk_p, a.sk_s, a.sk_h, a.sv_p, a.sv_s, a.sv_h, a.so_t, a.so_h, a.sbt,
        static_cast<float>(a.softmax_scale));
  });
  check_launch("paged_attention");
}

}  // namespace minengine
