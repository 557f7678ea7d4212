// Shared helpers of the minengine CUDA kernels: dtype dispatch, conversions, error checks, and the
// few device primitives the kernels use (launch, dynamic shared memory, cp.async, mma.sync), each
// with a CPU-emulated form when compiled with -DMINENGINE_EMULATE (see emulate.h).
#pragma once

#ifdef MINENGINE_EMULATE
#include "emulate.h"
#else
#include <cuda.h>  // CUtensorMap (a type only: the encoder is found through the runtime)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#endif

#include <cstdint>
#include <cstring>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

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


// n / d for 0 <= n < 2^31 and a divisor 1 <= d < 2^31 fixed at launch: a multiply-high, an add and a
// shift instead of an integer division (the round-up method of Hacker's Delight, 10-9):
// shift = ceil(log2 d), magic = floor(2^32 (2^shift - d) / d) + 1, n / d = (mulhi(n, magic) + n) >> shift.
struct FastDiv {
  uint32_t divisor = 1, magic = 1, shift = 0;
  FastDiv() = default;
  FastDiv(int64_t d, const char* what) {
    if (d < 1 || d > INT32_MAX) {
      throw std::invalid_argument(std::string(what) + " " + std::to_string(d) + "; allowed: 1 to 2147483647");
    }
    divisor = static_cast<uint32_t>(d);
    while ((uint64_t{1} << shift) < divisor) ++shift;
    magic = static_cast<uint32_t>((uint64_t{1} << 32) * ((uint64_t{1} << shift) - divisor) / divisor + 1);
  }
  __device__ __forceinline__ int div(int n) const {
#ifdef MINENGINE_EMULATE
    const uint32_t hi = static_cast<uint32_t>((static_cast<uint64_t>(static_cast<uint32_t>(n)) * magic) >> 32);
#else
    const uint32_t hi = __umulhi(static_cast<uint32_t>(n), magic);
#endif
    return static_cast<int>((hi + static_cast<uint32_t>(n)) >> shift);
  }
};

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

// One V-sized global load and store; the GPU faults on a vector access not aligned to its size.
template <typename V> __device__ __forceinline__ void copy_global(void* dst, const void* src) {
  if (reinterpret_cast<uintptr_t>(dst) % sizeof(V) != 0 || reinterpret_cast<uintptr_t>(src) % sizeof(V) != 0) {
    throw std::runtime_error("a " + std::to_string(sizeof(V)) + "-byte global access at a misaligned address");
  }
  std::memcpy(dst, src, sizeof(V));
}

template <typename T>
__device__ __forceinline__ void mma_16816(float d[4], const uint32_t a[4], const uint32_t b[2]) {
  emu::mma_m16n8k16<T>(d, a, b, d);
}
template <bool Trans> __device__ __forceinline__ void ldmatrix_x4(uint32_t r[4], const void* row) {
  emu::ldmatrix_x4(r, row, Trans);
}

// 2^x as the GPU's ex2.approx.ftz computes it where it matters here: results below the smallest
// normal float are 0 (the approximation error, about 2 ulp, is not modelled).
__device__ __forceinline__ float fast_exp2(float x) {
  const float y = std::exp2(x);
  return y < 1.17549435e-38f ? 0.f : y;
}

#define ME_HAS_WGMMA 1
template <int N, typename R> __device__ __forceinline__ void fence_registers(R*) {}
__device__ __forceinline__ uint32_t smem_address(const void* p) { return emu::shared_address(p); }
__device__ __forceinline__ void fence_proxy_async() { emu::fence_proxy_async(); }
__device__ __forceinline__ void wgmma_fence() { emu::wgmma_fence(); }
__device__ __forceinline__ void wgmma_commit() { emu::wgmma_commit(); }
template <int N> __device__ __forceinline__ void wgmma_wait() { emu::wgmma_wait(N); }
template <typename T, int N, int TransB, bool Accumulate>
__device__ __forceinline__ void wgmma_m64k16(float d[N / 2], const uint32_t a[4], uint64_t desc_b) {
  emu::wgmma_m64k16<T>(d, a, desc_b, N, TransB, Accumulate);
}

// mbarriers and TMA tile loads (emulate.h), and the tensor map type the host encodes.
using TensorMap = emu::TensorMap;
__device__ __forceinline__ void mbarrier_init(uint64_t* bar, int count) { emu::mbarrier_init(bar, count); }
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  emu::mbarrier_arrive_expect_tx(bar, bytes);
}
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity) { emu::mbarrier_wait(bar, parity); }
__device__ __forceinline__ bool elect_one() { return emu::lane() == 0; }
__device__ __forceinline__ void prefetch_tensor_map(const TensorMap*) {}
__device__ __forceinline__ void tma_load_4d(void* dst, const TensorMap* map, uint64_t* bar, int c0, int c1, int c2,
                                            int c3) {
  emu::tma_load_4d(dst, map, bar, c0, c1, c2, c3);
}

#else

#define ME_DYNAMIC_SMEM(name) extern __shared__ __align__(16) char name[]
#define ME_LAUNCH(kernel, grid, block, smem, stream, ...) (kernel)<<<(grid), (block), (smem), (stream)>>>(__VA_ARGS__)

template <typename V> __device__ __forceinline__ void copy_global(void* dst, const void* src) {
  *reinterpret_cast<V*>(dst) = *reinterpret_cast<const V*>(src);
}

// 2^x in one MUFU.EX2 (exp2f adds range fix-ups for denormal results, 4 instructions in all):
// about 2 ulp of error, results below the smallest normal float flushed to 0. Softmax weights that
// small (2^-126 of the row's largest) change nothing in a sum that holds a 1.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Raises a kernel's dynamic shared-memory limit past the default 48 KB, once per (kernel, device)
// (each kernel's size is a constant); a refusal is an error naming the size, and asked again next time.
inline void set_max_dynamic_smem(const void* kernel, int bytes) {
  if (bytes <= 48 * 1024) return;
  static std::mutex mutex;
  static std::set<std::pair<const void*, int>> done;
  int device = 0;
  cudaGetDevice(&device);
  std::lock_guard<std::mutex> lock(mutex);
  if (done.count({kernel, device})) return;
  const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err != cudaSuccess) {
    throw std::runtime_error("paged_attention needs " + std::to_string(bytes) +
                             " bytes of shared memory per block, which this device refused: " +
                             cudaGetErrorString(err));
  }
  done.insert({kernel, device});
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

// Four 8x8 16-bit matrices from shared memory into mma fragments: lanes 8i..8i+7 give the 16-byte
// rows of matrix i; lane l gets r[i] = its (row l / 4, columns 2 (l % 4), +1), or with Trans the
// transpose (rows 2 (l % 4), +1 of column l / 4): a B fragment of a row-major [k][n] tile.
template <bool Trans> __device__ __forceinline__ void ldmatrix_x4(uint32_t r[4], const void* row) {
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(row));
  if constexpr (Trans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address)
                 : "memory");
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address)
                 : "memory");
  }
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


// ---- Hopper warpgroup MMA (sm_90a) ---------------------------------------------------------------
// ME_HAS_WGMMA: this compilation pass can emit wgmma (the sm_90a device pass, or the emulator). In
// other passes the helpers trap; the host never launches them there (paged_attention checks
// the device and MINENGINE_SM90A, which setup.py defines when 9.0a is among the target archs).
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define ME_HAS_WGMMA 1
#else
#define ME_HAS_WGMMA 0
#endif

// An empty asm that reads and writes N registers: keeps the compiler from moving their accesses
// across wgmma_fence / wgmma_wait (a register written between the fence and a wgmma that uses it,
// or read before the wait, is undefined).
template <int N, typename R> __device__ __forceinline__ void fence_registers(R* r) {
  static_assert(sizeof(R) == 4, "32-bit registers");
#pragma unroll
  for (int i = 0; i < N; ++i) {
    if constexpr (std::is_same<R, float>::value) {
      asm volatile("" : "+f"(r[i])::"memory");
    } else {
      asm volatile("" : "+r"(r[i])::"memory");
    }
  }
}

// Address of a shared-memory location in the shared window (what wgmma descriptors hold).
__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Makes this thread's generic-proxy writes to shared memory (cp.async included) visible to the
// async proxy that wgmma reads through; a barrier then publishes them to the warpgroup.
__device__ __forceinline__ void fence_proxy_async() {
#if ME_HAS_WGMMA
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_fence() {
#if ME_HAS_WGMMA
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#if ME_HAS_WGMMA
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
template <int N> __device__ __forceinline__ void wgmma_wait() {
#if ME_HAS_WGMMA
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}

// ---- mbarriers and TMA (sm_90a) ------------------------------------------------------------------
// A transaction barrier in shared memory counts arrivals and the bytes TMA loads deliver; a phase
// completes when both are in. TMA tile loads read a box of a tensor described by a tensor map
// (the driver's CUtensorMap, encoded on the host and passed as a __grid_constant__ kernel
// parameter) into shared memory, zero-filling elements outside the tensor.
// Outside the sm_90a pass the helpers trap, as the wgmma ones do: the host never launches them there.
#if CUDART_VERSION >= 12000
using TensorMap = CUtensorMap;
#else
struct alignas(64) TensorMap {  // CUDA 11 has no TMA: the wgmma-tma kernel never runs (tma_applies)
  unsigned long long opaque[16];
};
#endif

__device__ __forceinline__ void mbarrier_init(uint64_t* bar, int count) {
#if ME_HAS_WGMMA
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_address(bar)), "r"(count) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");  // visible to the async proxy
#else
  __trap();
#endif
}
// Fetches a tensor map into the TMA unit's cache ahead of its first load.
__device__ __forceinline__ void prefetch_tensor_map(const TensorMap* map) {
#if ME_HAS_WGMMA
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
#endif
}
// This thread's arrival, with `bytes` more to come from TMA loads before the phase completes.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
#if ME_HAS_WGMMA
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_address(bar)), "r"(bytes)
               : "memory");
#else
  __trap();
#endif
}
// One lane of the (whole, converged) warp: true in exactly one. Unlike a test of the lane index, the
// compiler knows the rest of the warp agrees on what the elected lane does with warp-uniform values.
__device__ __forceinline__ bool elect_one() {
#if ME_HAS_WGMMA
  uint32_t elected = 0;
  asm volatile("{\n.reg .pred p;\nelect.sync _|p, 0xffffffff;\nselp.u32 %0, 1, 0, p;\n}\n" : "=r"(elected));
  return elected != 0;
#else
  return (threadIdx.x & 31) == 0;
#endif
}
// Returns once the phase with this parity has completed.
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity) {
#if ME_HAS_WGMMA
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(smem_address(bar)), "r"(parity)
        : "memory");
  } while (!done);
#else
  __trap();
#endif
}
// The box at coordinates (c0, c1, c2, c3), innermost first, of a 4-D map into shared memory at dst,
// completing on bar. `map` must be the address of a __grid_constant__ parameter (or global memory).
__device__ __forceinline__ void tma_load_4d(void* dst, const TensorMap* map, uint64_t* bar, int c0, int c1, int c2,
                                            int c3) {
#if ME_HAS_WGMMA
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], "
      "[%6];\n" ::"r"(smem_address(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(smem_address(bar))
      : "memory");
#else
  __trap();
#endif
}

// d[64 x N] = a[64 x 16] * b[16 x N] (+ d when Accumulate) for one warpgroup (4 warps), N = 64 or
// 128: A from registers (each warp 16 rows, the mma.sync m16n8k16 A layout), B from shared memory
// through a descriptor (TransB 0: K-major, 1: N-major), D in the m16n8 accumulator layout repeated
// over N / 8 column blocks: d[4 * j + i] = row (warp * 16 + g + 8 * (i >= 2)), column
// 8 j + 2 t + (i & 1).
// Accumulate false (scale-d 0) ignores d's old values, so a fresh product needs no zero fill.
#if ME_HAS_WGMMA
#define ME_ACC8(i)                                                                                \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]),         \
      "+f"(d[i + 6]), "+f"(d[i + 7])
#define ME_WGMMA_N64(TYPE)                                                                           \
  asm volatile(                                                                                      \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                                   \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE                                    \
      " {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"                                     \
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31},"                            \
      " {%32,%33,%34,%35}, %36, p, 1, 1, %38;\n}\n"                                                  \
      : ME_ACC8(0), ME_ACC8(8), ME_ACC8(16), ME_ACC8(24)                                             \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "n"(int(Accumulate)), "n"(TransB))
#define ME_WGMMA_N128(TYPE)                                                                          \
  asm volatile(                                                                                      \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                                                   \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE "." TYPE                                   \
      " {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"                                     \
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"                             \
      "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"                             \
      "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63},"                            \
      " {%64,%65,%66,%67}, %68, p, 1, 1, %70;\n}\n"                                                  \
      : ME_ACC8(0), ME_ACC8(8), ME_ACC8(16), ME_ACC8(24), ME_ACC8(32), ME_ACC8(40), ME_ACC8(48),     \
        ME_ACC8(56)                                                                                  \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "n"(int(Accumulate)), "n"(TransB))
#else
#define ME_WGMMA_N64(TYPE) __trap()
#define ME_WGMMA_N128(TYPE) __trap()
#endif

template <typename T, int N, int TransB, bool Accumulate>
__device__ __forceinline__ void wgmma_m64k16(float d[N / 2], const uint32_t a[4], uint64_t desc_b) {
  static_assert(std::is_same<T, __half>::value || std::is_same<T, __nv_bfloat16>::value, "wgmma takes fp16 or bf16");
  static_assert(N == 64 || N == 128, "wgmma N: 64 or 128");
  constexpr bool bf16 = std::is_same<T, __nv_bfloat16>::value;
  if constexpr (N == 64 && bf16) {
    ME_WGMMA_N64("bf16");
  } else if constexpr (N == 64) {
    ME_WGMMA_N64("f16");
  } else if constexpr (bf16) {
    ME_WGMMA_N128("bf16");
  } else {
    ME_WGMMA_N128("f16");
  }
}
#undef ME_WGMMA_N64
#undef ME_WGMMA_N128
#undef ME_ACC8

#endif

// Descriptor of a wgmma B operand in shared memory laid out in 128-byte swizzled atoms (8 rows of
// 128 bytes, the 16-byte chunk index XORed with the row index; atoms 1024-byte aligned): start
// address, leading / stride byte offsets (16-byte units), layout type 1 = 128B swizzle.
__device__ __forceinline__ uint64_t sw128_descriptor(uint32_t address, uint32_t leading, uint32_t stride) {
  return static_cast<uint64_t>((address & 0x3FFFF) >> 4) | (static_cast<uint64_t>(leading >> 4) << 16) |
         (static_cast<uint64_t>(stride >> 4) << 32) | (static_cast<uint64_t>(1) << 62);
}

// The descriptor of an operand `bytes` (a multiple of 16) past desc's: one add to the start address
// field (bits 0-13, in 16-byte units), which cannot carry out of it while the address stays inside
// the 256 KB window it covers (shared memory is at most 228 KB). Building each descriptor anew costs
// about 8 uniform-datapath instructions.
__device__ __forceinline__ uint64_t descriptor_plus(uint64_t desc, uint32_t bytes) { return desc + (bytes >> 4); }

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
