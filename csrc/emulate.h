// A CPU emulator for the CUDA kernels of csrc/, used by the tests on machines without a GPU.
//
// Compiling a .cu file as C++ with -DMINENGINE_EMULATE turns each launch into a loop over the grid:
// a block runs as blockDim fibers (ucontext) on one OS thread, switching only at barriers, so
// every thread of a block is a real call stack with its own registers, as on the GPU. Emulated:
// - __syncthreads() (block barrier) and the warp collectives (__shfl_xor_sync, mma.sync
//   m16n8k16 with fp32 accumulation) with the fragment layouts of the PTX ISA;
// - cp.async: a copy is deferred until the thread waits for its group, so reading shared memory
//   before cp_async_wait sees stale data, as it may on the GPU;
// - dynamic shared memory, one buffer per block, filled with a NaN pattern before each block;
// - the alignment rule of cp.async (source and destination aligned to the copy size).
// A barrier that not every thread reaches (divergence, or a thread that returned early while
// others wait) is reported as an error instead of hanging. Blocks run one after another, so
// races between blocks are not found; the kernels must not have any (they write disjoint outputs).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <ucontext.h>
#include <vector_types.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

namespace minengine::emu {

struct Barrier {
  int expected = 0, arrived = 0;
  uint64_t generation = 0;
};

struct CopyOp {
  void* dst;
  const void* src;
  int bytes, src_bytes;
};

struct Fiber {
  ucontext_t context;
  std::vector<char> stack;
  bool done = false;
  unsigned index = 0;
  uint64_t collectives = 0;                  // warp collectives entered (selects the exchange slot)
  std::vector<std::vector<CopyOp>> groups;   // committed cp.async groups, oldest first
  std::vector<CopyOp> open;                  // cp.async issued since the last commit
};

// Per-warp exchange area of the collectives: two slots (double buffered) of 32 lanes.
struct LaneSlot {
  uint32_t a[4], b[2];
  float c[4];
  uint64_t word;
};

struct Block {
  std::vector<Fiber> fibers;
  ucontext_t scheduler;
  Fiber* current = nullptr;
  uint64_t events = 0;  // barrier arrivals and finished threads: progress of the block
  Barrier block_barrier;
  std::vector<Barrier> warp_barriers;
  std::vector<LaneSlot> exchange;  // [warp][slot][lane]
  std::vector<char> smem;
  std::string error;
  std::function<void()> body;
  uint3 block_idx{0, 0, 0};
  dim3 grid{1, 1, 1}, block{1, 1, 1};
};

inline Block& state() {
  static Block b;
  return b;
}

inline void yield() {
  Block& b = state();
  swapcontext(&b.current->context, &b.scheduler);
}

inline void wait(Barrier& bar) {
  Block& b = state();
  const uint64_t gen = bar.generation;
  ++b.events;
  if (++bar.arrived == bar.expected) {
    bar.arrived = 0;
    ++bar.generation;
    return;
  }
  while (bar.generation == gen) yield();
}

inline unsigned thread_index() { return state().current->index; }
inline unsigned lane() { return thread_index() & 31u; }
inline unsigned warp() { return thread_index() >> 5; }

inline LaneSlot* warp_slot(uint64_t k) {
  Block& b = state();
  return &b.exchange[(warp() * 2 + (k & 1)) * 32];
}

// Runs one collective: every lane deposits into its slot, waits for the whole warp, then reads.
// Double buffering makes one barrier enough: a lane can only reach collective k + 2 (which reuses
// slot k's buffer) after all lanes arrived at k + 1, that is after they have read slot k.
template <typename Deposit, typename Read>
inline auto collective(Deposit deposit, Read read) {
  Fiber* f = state().current;
  LaneSlot* slots = warp_slot(f->collectives++);
  deposit(slots[lane()]);
  wait(state().warp_barriers[warp()]);
  return read(slots);
}

inline void syncthreads() { wait(state().block_barrier); }

template <typename V>
inline V shfl_xor(V value, int offset) {
  static_assert(sizeof(V) <= sizeof(uint64_t), "shuffle of a type wider than 64 bits");
  return collective([&](LaneSlot& s) { std::memcpy(&s.word, &value, sizeof(V)); },
                    [&](LaneSlot* slots) {
                      V out;
                      std::memcpy(&out, &slots[(lane() ^ static_cast<unsigned>(offset)) & 31u].word, sizeof(V));
                      return out;
                    });
}

template <typename T>
inline float half_of(uint32_t word, int which) {
  const uint16_t bits = static_cast<uint16_t>(which ? word >> 16 : word & 0xffffu);
  T value;
  std::memcpy(&value, &bits, sizeof(bits));
  return static_cast<float>(value);
}

// d = a * b + c for one warp, m16n8k16, row-major A (16x16), column-major B (16x8), fp32 C/D.
// Lane l holds (group g = l / 4, t = l % 4):
//   A: a[0] = (g, 2t..2t+1), a[1] = (g+8, 2t..), a[2] = (g, 2t+8..), a[3] = (g+8, 2t+8..)
//   B: b[0] = (k 2t..2t+1, n g), b[1] = (k 2t+8..2t+9, n g)
//   C/D: c[0..1] = (g, 2t..2t+1), c[2..3] = (g+8, 2t..2t+1)
// Within a 32-bit register the lower half holds the lower column (A) or row (B) index.
template <typename T>
inline void mma_m16n8k16(float d[4], const uint32_t a[4], const uint32_t b[2], const float c[4]) {
  collective(
      [&](LaneSlot& s) {
        std::memcpy(s.a, a, sizeof(s.a));
        std::memcpy(s.b, b, sizeof(s.b));
      },
      [&](LaneSlot* slots) {
        auto A = [&](int r, int k) {
          const LaneSlot& s = slots[(r % 8) * 4 + (k % 8) / 2];
          return half_of<T>(s.a[(r >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0)], k % 2);
        };
        auto B = [&](int k, int n) {
          const LaneSlot& s = slots[n * 4 + (k % 8) / 2];
          return half_of<T>(s.b[k >= 8 ? 1 : 0], k % 2);
        };
        const int g = static_cast<int>(lane() / 4), t = static_cast<int>(lane() % 4);
        for (int i = 0; i < 4; ++i) {
          const int r = g + (i >= 2 ? 8 : 0), n = 2 * t + (i % 2);
          float sum = c[i];
          for (int k = 0; k < 16; ++k) sum += A(r, k) * B(k, n);
          d[i] = sum;
        }
        return 0;
      });
}

inline void cp_async(void* dst, const void* src, int bytes, int src_bytes) {
  // The GPU faults on a cp.async whose addresses are not aligned to its size.
  if (reinterpret_cast<uintptr_t>(dst) % bytes != 0 || reinterpret_cast<uintptr_t>(src) % bytes != 0) {
    throw std::runtime_error("cp.async of " + std::to_string(bytes) + " bytes from a misaligned address");
  }
  state().current->open.push_back({dst, src, bytes, src_bytes});
}

inline void cp_async_commit() {
  Fiber* f = state().current;
  f->groups.push_back(std::move(f->open));
  f->open.clear();
}

inline void cp_async_wait(int pending) {
  Fiber* f = state().current;
  while (static_cast<int>(f->groups.size()) > pending) {
    for (const CopyOp& op : f->groups.front()) {
      std::memcpy(op.dst, op.src, static_cast<size_t>(op.src_bytes));
      std::memset(static_cast<char*>(op.dst) + op.src_bytes, 0, static_cast<size_t>(op.bytes - op.src_bytes));
    }
    f->groups.erase(f->groups.begin());
  }
}

inline void fiber_entry() {
  Block& b = state();
  try {
    b.body();
  } catch (const std::exception& e) {
    if (b.error.empty()) b.error = e.what();
  }
  b.current->done = true;
  ++b.events;
  swapcontext(&b.current->context, &b.scheduler);
}

inline void run_block() {
  Block& b = state();
  const unsigned threads = b.block.x * b.block.y * b.block.z;
  constexpr size_t kStack = 256 * 1024;
  if (b.fibers.size() < threads) b.fibers.resize(threads);
  b.block_barrier = Barrier{static_cast<int>(threads)};
  b.warp_barriers.assign((threads + 31) / 32, Barrier{32});
  b.exchange.assign(b.warp_barriers.size() * 2 * 32, LaneSlot{});
  std::fill(b.smem.begin(), b.smem.end(), static_cast<char>(0xff));  // NaN in every float type
  for (unsigned i = 0; i < threads; ++i) {
    Fiber& f = b.fibers[i];
    f.stack.resize(kStack);
    f.done = false;
    f.index = i;
    f.collectives = 0;
    f.groups.clear();
    f.open.clear();
    getcontext(&f.context);
    f.context.uc_stack.ss_sp = f.stack.data();
    f.context.uc_stack.ss_size = f.stack.size();
    f.context.uc_link = nullptr;
    makecontext(&f.context, fiber_entry, 0);
  }
  for (unsigned left = threads; left > 0;) {
    const uint64_t before = b.events;
    for (unsigned i = 0; i < threads; ++i) {
      Fiber& f = b.fibers[i];
      if (f.done) continue;
      b.current = &f;
      swapcontext(&b.scheduler, &f.context);
      if (f.done) --left;
    }
    if (left > 0 && b.events == before) {
      throw std::runtime_error("emulated block (" + std::to_string(b.block_idx.x) + ", " +
                               std::to_string(b.block_idx.y) + ", " + std::to_string(b.block_idx.z) +
                               "): a barrier or warp collective that not every thread reaches");
    }
  }
  if (!b.error.empty()) throw std::runtime_error(b.error);
}

template <typename F>
inline void launch(dim3 grid, dim3 block, size_t smem_bytes, F&& body) {
  Block& b = state();
  if (block.x * block.y * block.z % 32 != 0) throw std::runtime_error("emulated blocks must be whole warps");
  b.grid = grid;
  b.block = block;
  b.smem.assign(smem_bytes, 0);
  b.body = std::forward<F>(body);
  b.error.clear();
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        b.block_idx = uint3{x, y, z};
        run_block();
      }
}

inline uint3 thread_idx3() {
  const Block& b = state();
  const unsigned i = thread_index();
  return uint3{i % b.block.x, (i / b.block.x) % b.block.y, i / (b.block.x * b.block.y)};
}

}  // namespace minengine::emu

// cuda_fp16.h brings the CUDA host headers, which already define the execution-space keywords
// away for a host compiler; define whatever they left.
#ifndef __global__
#define __global__
#endif
#ifndef __device__
#define __device__
#endif
#ifndef __forceinline__
#define __forceinline__ inline
#endif
#ifndef __launch_bounds__
#define __launch_bounds__(...)
#endif
#define threadIdx (::minengine::emu::thread_idx3())
#define blockIdx (::minengine::emu::state().block_idx)
#define blockDim (::minengine::emu::state().block)
#define gridDim (::minengine::emu::state().grid)
#define __syncthreads() ::minengine::emu::syncthreads()
#define __shfl_xor_sync(mask, value, offset) ::minengine::emu::shfl_xor((value), (offset))
