// Shared helpers of the minengine CUDA kernels: dtype dispatch, conversions, error checks.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
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

inline void check_launch(const char* what) {
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(err));
  }
}

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
