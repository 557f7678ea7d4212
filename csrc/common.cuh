// Shared helpers of the minengine CUDA kernels: dtype dispatch, conversions, error checks, and the
// few device primitives the kernels use (launch, dynamic shared memory, cp.async, mma.sync), each
// with a CPU-emulated form when compiled with -DMINENGINE_EMULATE (see emulate.h).
#pragma once

#ifdef MINENGINE_EMULATE
#include "emulate.h"
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#endif

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace minengine {

// dtype codes shared with minengine/ops/cuda.py
enum DType : int { kFloat16 = 0, kBFloat16 = 1, kFloat32 = 2 };
enum IndexType : int { kInt32 = 0, kInt64 = 1 };

template <typename T> __device__ __forceinline__ float to_float(T x);
template <> __device__ __forceinline__ float to_float<float>(float x) { return x; }
template <> __device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// Two 16-bit elements in one 32-bit register, the first in the lower half (mma operand order).
template <typename T> __device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  static_assert(sizeof(T) == 2, "pack2 packs 16-bit types");
  const T pair[2] = {from_float<T>(lo), from_float<T>(hi)};
  uint32_t word;
  memcpy(&word, pair, sizeof(word));
  return word;
}

__device__ __forceinline__ uint32_t pack_bits(uint16_t lo, uint16_t hi) {
  return static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
}

// ---- device primitives -------------------------------------------------------------------------
#ifdef MINENGINE_EMULATE

#define ME_DYNAMIC_SMEM(name) char* name = ::minengine::emu::state().smem.data()
#define ME_LAUNCH(kernel, grid, block, smem, stream, ...) \
  ::minengine::emu::launch((grid), (block), (smem), [=]() { (kernel)(__VA_ARGS__); })

inline void set_max_dynamic_smem(const void*, int) {}

__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, int src_bytes) {
  emu::cp_async(smem, gmem, 16, src_bytes);
}
__device__ __forceinline__ void cp_async_commit() { emu::cp_async_commit(); }
template <int N> __device__ __forceinline__ void cp_async_wait() { emu::cp_async_wait(N); }

template <typename T>
__device__ __forceinline__ void mma_16816(float d[4], const uint32_t a[4], const uint32_t b[2]) {
  emu::mma_m16n8k16<T>(d, a, b, d);
}

#else

#define ME_DYNAMIC_SMEM(name) extern __shared__ __align__(16) char name[]
#define ME_LAUNCH(kernel, grid, block, smem, stream, ...) (kernel)<<<(grid), (block), (smem), (stream)>>>(__VA_ARGS__)

inline void set_max_dynamic_smem(const void* kernel, int bytes) {
  if (bytes > 48 * 1024) cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
}

// 16-byte global -> shared copy that bypasses L1; src_bytes < 16 zero-fills the rest (0: no read).
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, int src_bytes) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(src_bytes) : "memory");
}
// The "memory" clobbers keep the compiler from moving shared-memory accesses across the waits.
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// d += a * b on the tensor cores: m16n8k16, fp32 accumulation (fragment layouts: emulate.h).
template <typename T> __device__ __forceinline__ void mma_16816(float d[4], const uint32_t a[4], const uint32_t b[2]);
template <> __device__ __forceinline__ void mma_16816<__half>(float d[4], const uint32_t a[4], const uint32_t b[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float d[4], const uint32_t a[4], const uint32_t b[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

#endif

#ifdef MINENGINE_EMULATE
inline void check_launch(const char*) {}  // emulated launches throw their own errors
#else
inline void check_launch(const char* what) {
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(err));
  }
}
#endif

// Calls f with a null pointer of the element type named by a dtype code.
template <typename F> void dispatch_float(int dtype, F&& f) {
  switch (dtype) {
    case kFloat16: f(static_cast<__half*>(nullptr)); break;
    case kBFloat16: f(static_cast<__nv_bfloat16*>(nullptr)); break;
    case kFloat32: f(static_cast<float*>(nullptr)); break;
    default: throw std::invalid_argument("dtype code " + std::to_string(dtype) + "; allowed: 0 (fp16), 1 (bf16), 2 (fp32)");
  }
}

template <typename F> void dispatch_index(int dtype, F&& f) {
  switch (dtype) {
    case kInt32: f(static_cast<int32_t*>(nullptr)); break;
    case kInt64: f(static_cast<int64_t*>(nullptr)); break;
    default: throw std::invalid_argument("index dtype code " + std::to_string(dtype) + "; allowed: 0 (int32), 1 (int64)");
  }
}

}  // namespace minengine
