// A CPU emulator for the CUDA kernels of csrc/, used by the tests on machines without a GPU.
//
// Compiling a .cu file as C++ with -DMINENGINE_EMULATE turns each launch into a loop over the grid:
// a block runs as blockDim fibers (ucontext) on one OS thread, switching only at barriers, so
// every thread of a block is a real call stack with its own registers, as on the GPU. Emulated:
// - __syncthreads() (block barrier) and the warp collectives (__shfl_xor_sync of whole warps, mma.sync
//   m16n8k16 with fp32 accumulation, ldmatrix x4) with the fragment layouts of the PTX ISA;
// - cp.async: a copy is deferred until the thread waits for its group, so reading shared memory
//   before cp_async_wait sees stale data, as it may on the GPU;
// - Hopper's wgmma (m64nNk16 with N = 64 or 128, A from registers, B from shared memory through a
//   128B-swizzle descriptor, scale-d 0 or 1) as an asynchronous warpgroup operation: it runs when
//   the warpgroup waits for its group, reading shared memory and writing the accumulators then, so
//   touching either between issue and wait gives wrong results here too (the A registers are read
//   at issue, unchecked).
//   A wgmma needs a wgmma.fence since the last wait, and shared memory written by cp.async needs
//   fence.proxy.async before a wgmma reads it;
// - Hopper's mbarriers (init, arrive with an expected transaction count, wait on a phase parity) and
//   TMA tile loads (cp.async.bulk.tensor, 4-D, 128B swizzle, out-of-bound elements zero-filled)
//   that complete on an mbarrier: a load lands when a thread first waits for the barrier's phase
//   (or at issue, with cp.async's landing at issue), and its source elements are checked as
//   cp.async's are (readable, no NaN);
// - dynamic shared memory, one buffer per block, filled with a NaN pattern before each block;
// - the alignment rule of cp.async (source and destination aligned to the copy size), and its
//   bounds: the destination inside the block's shared memory, the source inside the memory the
//   caller declared readable for the launch (set_readable; the K/V caches), and never a NaN: the
//   contract tests fill every cache slot a kernel must not read (past seq_len) with NaN, so a
//   copy of one fails even where the kernel would have masked its value away.
// A barrier that not every thread reaches (divergence, or a thread that returned early while
// others wait) is reported as an error instead of hanging. Blocks run one after another, so
// races between blocks are not found; the kernels must not have any (they write disjoint outputs).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <ucontext.h>
#include <vector_types.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
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

struct WgmmaOp {
  float* d;
  uint32_t a[4];
  uint64_t desc;
  int n, trans_b, bf16, accumulate;
};

// A TMA tensor map as this emulator encodes it (the driver's CUtensorMap is opaque): a tiled map
// of 2-byte elements with 128B swizzle, dims innermost first, strides in bytes (dim 0 contiguous).
struct alignas(64) TensorMap {
  const char* base = nullptr;
  uint64_t dims[4] = {0, 0, 0, 0};
  uint64_t strides[4] = {2, 0, 0, 0};
  uint32_t box[4] = {0, 0, 0, 0};
  bool encoded = false;
};

struct TmaOp {
  uint32_t dst;  // shared-window address
  TensorMap map;  // read at issue, as the GPU does
  int coords[4];
};

// An mbarrier: `expected` arrivals a phase, the ones still pending, the transaction bytes still
// expected (arrive.expect_tx adds, landed TMA loads subtract), the completed phases, and the TMA
// loads issued against the current phase that have not landed.
struct MBarrier {
  int expected = 0, pending = 0;
  int64_t tx = 0;
  uint64_t phase = 0;
  std::vector<TmaOp> loads;
};

struct Fiber {
  ucontext_t context;
  std::vector<char> stack;
  bool done = false;
  unsigned index = 0;
  uint64_t collectives = 0;                  // warp collectives entered (selects the exchange slot)
  std::vector<std::vector<CopyOp>> groups;   // committed cp.async groups, oldest first
  std::vector<CopyOp> open;                  // cp.async issued since the last commit
  std::vector<std::vector<WgmmaOp>> wg_groups;  // committed wgmma groups, oldest first
  std::vector<WgmmaOp> wg_open;                 // wgmma issued since the last commit
  bool wg_fenced = false;    // wgmma.fence since the last wgmma wait
  bool proxy_dirty = false;  // landed cp.async not yet followed by fence.proxy.async
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
  std::vector<Barrier> warpgroup_barriers;
  std::vector<LaneSlot> exchange;  // [warp][slot][lane]
  std::vector<char> smem;
  std::vector<std::pair<uint32_t, MBarrier>> mbarriers;  // by shared-window address, this block's
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

// Returns true in the thread that arrived last: it runs on before any other thread resumes.
inline bool wait(Barrier& bar) {
  Block& b = state();
  const uint64_t gen = bar.generation;
  ++b.events;
  if (++bar.arrived == bar.expected) {
    bar.arrived = 0;
    ++bar.generation;
    return true;
  }
  while (bar.generation == gen) yield();
  return false;
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

// A whole-warp shuffle: every lane deposits `value` and reads lane source(its lane)'s. Every lane
// takes part in the emulator's collectives; the kernels only shuffle whole warps.
template <typename V, typename Source>
inline V shuffle(const char* name, unsigned mask, V value, Source source) {
  static_assert(sizeof(V) <= sizeof(uint64_t), "shuffle of a type wider than 64 bits");
  if (mask != 0xffffffffu) throw std::runtime_error(std::string(name) + " with a partial lane mask (not emulated)");
  return collective([&](LaneSlot& s) { std::memcpy(&s.word, &value, sizeof(V)); },
                    [&](LaneSlot* slots) {
                      V out;
                      std::memcpy(&out, &slots[source(lane()) & 31u].word, sizeof(V));
                      return out;
                    });
}

template <typename V>
inline V shfl_xor(unsigned mask, V value, int offset) {
  return shuffle("__shfl_xor_sync", mask, value, [&](unsigned l) { return l ^ static_cast<unsigned>(offset); });
}

// __shfl_sync: every lane gets lane src's value.
template <typename V>
inline V shfl_idx(unsigned mask, V value, int src) {
  return shuffle("__shfl_sync", mask, value, [&](unsigned) { return static_cast<unsigned>(src); });
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

// ldmatrix.sync.aligned.m8n8.x4(.trans).shared.b16: lanes 8i..8i+7 give the 16-byte rows of matrix
// i; lane l receives r[i] = matrix i's (row l / 4, columns 2 (l % 4), +1), or with trans its
// (rows 2 (l % 4), +1; column l / 4), the lower index in the lower half.
inline void ldmatrix_x4(uint32_t r[4], const void* row, bool trans) {
  const Block& b = state();
  const char* c = static_cast<const char*>(row);
  if (c < b.smem.data() || c + 16 > b.smem.data() + b.smem.size()) {
    throw std::runtime_error("ldmatrix from outside shared memory");
  }
  if ((c - b.smem.data()) % 16 != 0) throw std::runtime_error("ldmatrix row address not 16-byte aligned");
  // Each lane's row is read when it arrives (a lane may write shared memory right after the load).
  collective([&](LaneSlot& s) { std::memcpy(s.a, row, sizeof(s.a)); },
             [&](LaneSlot* slots) {
               auto element = [&](int matrix, int i, int j) {  // row i, column j of a matrix
                 uint16_t bits;
                 std::memcpy(&bits, reinterpret_cast<const char*>(slots[8 * matrix + i].a) + 2 * j, 2);
                 return static_cast<uint32_t>(bits);
               };
               const int g = static_cast<int>(lane() / 4), t = static_cast<int>(lane() % 4);
               for (int m = 0; m < 4; ++m) {
                 r[m] = trans ? element(m, 2 * t, g) | (element(m, 2 * t + 1, g) << 16)
                              : element(m, g, 2 * t) | (element(m, g, 2 * t + 1) << 16);
               }
               return 0;
             });
}

// When a cp.async lands: on the GPU, anywhere between its issue and the wait that covers it. By
// default the emulator lands it as late as allowed (at that wait), which exposes a read of a stage
// before the barrier that follows the wait (read after write). Landing it at issue, with one warp
// at a time running ahead (run_block), exposes a refill issued before every warp has finished
// reading the buffer (write after read): the warps that run later read the new data. The tests
// run both.
inline bool& land_at_issue() {
  static bool eager = false;
  return eager;
}

// Global memory a cp.async may read during the next launch: [begin, end) byte ranges (empty:
// unchecked). The launcher's caller sets it (cuda_emulator.py: the K/V caches) and clears it.
inline std::vector<std::pair<uintptr_t, uintptr_t>>& readable() {
  static std::vector<std::pair<uintptr_t, uintptr_t>> ranges;
  return ranges;
}

// A half-precision NaN (fp16 0x7c01..0x7fff; bf16 NaN 0x7f81.. falls in it too, as do only bf16
// values beyond 2^120 otherwise), either sign. cp.async moves only fp16/bf16 data here: fp32 runs
// the CUDA-core kernel, which has none.
inline bool has_nan16(const void* src, int bytes) {
  const auto* h = static_cast<const uint16_t*>(src);
  for (int i = 0; i < bytes / 2; ++i) {
    if ((h[i] & 0x7c00) == 0x7c00 && (h[i] & 0x03ff) != 0) return true;
  }
  return false;
}

inline void check_cp_async(const void* dst, const void* src, int bytes, int src_bytes) {
  const Block& b = state();
  const auto d = reinterpret_cast<uintptr_t>(dst), s = reinterpret_cast<uintptr_t>(src);
  // The GPU faults on a cp.async whose addresses are not aligned to its size.
  if (d % bytes != 0 || s % bytes != 0) {
    throw std::runtime_error("cp.async of " + std::to_string(bytes) + " bytes from a misaligned address");
  }
  if (src_bytes < 0 || src_bytes > bytes) {
    throw std::runtime_error("cp.async source size " + std::to_string(src_bytes) + " outside 0.." +
                             std::to_string(bytes));
  }
  const auto base = reinterpret_cast<uintptr_t>(b.smem.data());
  if (d < base || d + bytes > base + b.smem.size()) {
    throw std::runtime_error("cp.async to outside shared memory (offset " + std::to_string(d - base) + " of " +
                             std::to_string(b.smem.size()) + " bytes)");
  }
  if (src_bytes == 0) return;  // reads nothing
  const auto& ranges = readable();
  if (!ranges.empty() && std::none_of(ranges.begin(), ranges.end(), [&](const auto& r) {
        return s >= r.first && s + src_bytes <= r.second;
      })) {
    throw std::runtime_error("cp.async reads outside the memory declared readable (the K/V caches)");
  }
  if (has_nan16(src, src_bytes)) {
    throw std::runtime_error("cp.async reads a NaN: a K/V slot the kernel must not read (past seq_len)");
  }
}

inline void cp_async(void* dst, const void* src, int bytes, int src_bytes) {
  check_cp_async(dst, src, bytes, src_bytes);
  if (land_at_issue()) {  // its group stays empty, so the proxy-fence check is the late mode's job
    std::memcpy(dst, src, static_cast<size_t>(src_bytes));
    std::memset(static_cast<char*>(dst) + src_bytes, 0, static_cast<size_t>(bytes - src_bytes));
    return;
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
    if (!f->groups.front().empty()) f->proxy_dirty = true;
    for (const CopyOp& op : f->groups.front()) {
      std::memcpy(op.dst, op.src, static_cast<size_t>(op.src_bytes));
      std::memset(static_cast<char*>(op.dst) + op.src_bytes, 0, static_cast<size_t>(op.bytes - op.src_bytes));
    }
    f->groups.erase(f->groups.begin());
  }
}

// ---- wgmma --------------------------------------------------------------------------------------

// Dynamic shared memory starts at this shared-window address: 16-byte aligned and no more, as the
// GPU promises, so a kernel that needs 1024-byte aligned swizzle atoms must align them itself.
constexpr uint32_t kSharedBase = 0x90;

inline uint32_t shared_address(const void* p) {
  const Block& b = state();
  const char* c = static_cast<const char*>(p);
  if (c < b.smem.data() || c > b.smem.data() + b.smem.size()) {
    throw std::runtime_error("shared-memory address of a pointer outside shared memory");
  }
  return kSharedBase + static_cast<uint32_t>(c - b.smem.data());
}

inline void fence_proxy_async() { state().current->proxy_dirty = false; }
inline void wgmma_fence() { state().current->wg_fenced = true; }

inline Fiber* warpgroup_fibers() {
  Block& b = state();
  return &b.fibers[thread_index() / 128 * 128];
}

template <typename T>
inline void wgmma_m64k16(float* d, const uint32_t a[4], uint64_t desc, int n, int trans_b, bool accumulate) {
  Block& b = state();
  Fiber* f = b.current;
  if (b.block.x * b.block.y * b.block.z % 128 != 0) throw std::runtime_error("wgmma in a block of partial warpgroups");
  if (!f->wg_fenced) throw std::runtime_error("wgmma issued without wgmma.fence since the last wgmma wait");
  const Fiber* group = warpgroup_fibers();
  for (int i = 0; i < 128; ++i) {
    if (group[i].proxy_dirty) {
      throw std::runtime_error("wgmma reads shared memory written by cp.async without fence.proxy.async");
    }
  }
  if (n != 64 && n != 128) throw std::runtime_error("emulated wgmma takes N = 64 or 128");
  WgmmaOp op{d, {a[0], a[1], a[2], a[3]}, desc, n, trans_b, std::is_same<T, __nv_bfloat16>::value ? 1 : 0,
             accumulate ? 1 : 0};
  f->wg_open.push_back(op);
}

inline void wgmma_commit() {
  Fiber* f = state().current;
  f->wg_groups.push_back(std::move(f->wg_open));
  f->wg_open.clear();
}

// One wgmma over the 128 threads' parts: D = A * B (+ D when it accumulates), B read through the
// descriptor now.
inline void wgmma_execute(Fiber* group, size_t index) {
  const Block& b = state();
  const WgmmaOp& first = group[0].wg_groups.front()[index];
  const uint64_t desc = first.desc;
  if ((desc >> 62) != 1) throw std::runtime_error("emulated wgmma takes only 128B-swizzle descriptors");
  if (((desc >> 49) & 7) != 0) throw std::runtime_error("emulated wgmma takes only base offset 0");
  const uint32_t start = static_cast<uint32_t>(desc & 0x3FFF) << 4;
  const uint32_t leading = static_cast<uint32_t>((desc >> 16) & 0x3FFF) << 4;
  const uint32_t stride = static_cast<uint32_t>((desc >> 32) & 0x3FFF) << 4;
  auto element = [&](uint32_t address, int bf16) {
    address ^= ((address >> 7) & 7u) << 4;  // Swizzle<3,4,3>: 16-byte chunk ^= row within the atom
    if (address < kSharedBase || address - kSharedBase + 2 > b.smem.size()) {
      throw std::runtime_error("wgmma B operand outside shared memory");
    }
    uint16_t bits;
    std::memcpy(&bits, b.smem.data() + (address - kSharedBase), sizeof(bits));
    return bf16 ? half_of<__nv_bfloat16>(bits, 0) : half_of<__half>(bits, 0);
  };
  const int N = first.n;
  float B[16][128];
  for (int k = 0; k < 16; ++k) {
    for (int n = 0; n < N; ++n) {
      const uint32_t address =
          first.trans_b
              ? start + (n / 64) * leading + (n % 64) * 2 + (k / 8) * stride + (k % 8) * 128  // N-major
              : start + (n / 8) * stride + (n % 8) * 128 + k * 2;                              // K-major
      B[k][n] = element(address, first.bf16);
    }
  }
  for (int m = 0; m < 64; ++m) {
    const int w = m / 16, r = m % 16;
    float A[16];
    for (int k = 0; k < 16; ++k) {
      const WgmmaOp& op = group[w * 32 + (r % 8) * 4 + (k % 8) / 2].wg_groups.front()[index];
      if (op.desc != desc || op.n != N || op.trans_b != first.trans_b || op.bf16 != first.bf16 ||
          op.accumulate != first.accumulate) {
        throw std::runtime_error("the threads of a warpgroup issued different wgmma operations");
      }
      const uint32_t word = op.a[(r >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0)];
      A[k] = first.bf16 ? half_of<__nv_bfloat16>(word, k % 2) : half_of<__half>(word, k % 2);
    }
    for (int n = 0; n < N; ++n) {
      float sum = 0.f;
      for (int k = 0; k < 16; ++k) sum += A[k] * B[k][n];
      const WgmmaOp& out = group[w * 32 + (r % 8) * 4 + (n % 8) / 2].wg_groups.front()[index];
      float& d = out.d[4 * (n / 8) + (r >= 8 ? 2 : 0) + (n % 2)];
      d = first.accumulate ? d + sum : sum;
    }
  }
}

// wgmma.wait_group: all 128 threads arrive; the last runs every group older than the newest
// `pending` ones, for the whole warpgroup, before any thread resumes.
inline void wgmma_wait(int pending) {
  Block& b = state();
  Fiber* f = b.current;
  if (!wait(b.warpgroup_barriers[thread_index() / 128])) {
    f->wg_fenced = false;
    return;
  }
  Fiber* group = warpgroup_fibers();
  while (static_cast<int>(group[0].wg_groups.size()) > pending) {
    const size_t ops = group[0].wg_groups.front().size();
    for (int i = 0; i < 128; ++i) {
      if (group[i].wg_groups.size() != group[0].wg_groups.size() || group[i].wg_groups.front().size() != ops) {
        throw std::runtime_error("the threads of a warpgroup committed different wgmma groups");
      }
    }
    for (size_t j = 0; j < ops; ++j) wgmma_execute(group, j);
    for (int i = 0; i < 128; ++i) group[i].wg_groups.erase(group[i].wg_groups.begin());
  }
  f->wg_fenced = false;
}

// ---- mbarriers and TMA ----------------------------------------------------------------------------

inline MBarrier* find_mbarrier(uint32_t address) {
  for (auto& [at, bar] : state().mbarriers) {
    if (at == address) return &bar;
  }
  return nullptr;
}

inline MBarrier& mbarrier_at(const void* p) {
  MBarrier* bar = find_mbarrier(shared_address(p));
  if (bar == nullptr) throw std::runtime_error("an mbarrier used before mbarrier.init");
  return *bar;
}

inline void mbarrier_init(void* p, int count) {
  const uint32_t address = shared_address(p);
  if (address % 8 != 0) throw std::runtime_error("mbarrier not 8-byte aligned");
  if (count < 1) throw std::runtime_error("mbarrier.init with count " + std::to_string(count));
  MBarrier* bar = find_mbarrier(address);
  if (bar == nullptr) bar = &state().mbarriers.emplace_back(address, MBarrier{}).second;
  *bar = MBarrier{count, count, 0, 0, {}};
}

inline void complete_phase_if_done(MBarrier& bar) {
  if (bar.pending == 0 && bar.tx == 0) {
    if (!bar.loads.empty()) throw std::runtime_error("an mbarrier phase completed with TMA loads in flight");
    ++bar.phase;
    bar.pending = bar.expected;
  }
}

inline void mbarrier_arrive_expect_tx(void* p, uint32_t bytes) {
  MBarrier& bar = mbarrier_at(p);
  if (bar.pending == 0) throw std::runtime_error("mbarrier arrival past the expected count");
  bar.tx += bytes;
  --bar.pending;
  ++state().events;  // progress: a thread waiting on the barrier may go on
  complete_phase_if_done(bar);
}

// One TMA tile load: the box at `coords` of the map into shared memory at dst, rows of box[0]
// elements (128 bytes) with the 128B swizzle (16-byte chunk ^= shared address bits 7-9).
inline void tma_land(const TmaOp& op) {
  const Block& b = state();
  const TensorMap& m = op.map;
  const auto& ranges = readable();
  uint32_t at = op.dst;
  for (uint32_t i3 = 0; i3 < m.box[3]; ++i3)
    for (uint32_t i2 = 0; i2 < m.box[2]; ++i2)
      for (uint32_t i1 = 0; i1 < m.box[1]; ++i1)
        for (uint32_t i0 = 0; i0 < m.box[0]; ++i0, at += 2) {
          const int64_t c[4] = {int64_t{op.coords[0]} + i0, int64_t{op.coords[1]} + i1, int64_t{op.coords[2]} + i2,
                                int64_t{op.coords[3]} + i3};
          uint16_t bits = 0;
          bool inside = true;
          for (int d = 0; d < 4; ++d) inside = inside && c[d] >= 0 && static_cast<uint64_t>(c[d]) < m.dims[d];
          if (inside) {
            const char* src = m.base;
            for (int d = 0; d < 4; ++d) src += c[d] * static_cast<int64_t>(m.strides[d]);
            const auto s = reinterpret_cast<uintptr_t>(src);
            if (!ranges.empty() && std::none_of(ranges.begin(), ranges.end(), [&](const auto& r) {
                  return s >= r.first && s + 2 <= r.second;
                })) {
              throw std::runtime_error("TMA load reads outside the memory declared readable (the K/V caches)");
            }
            if (has_nan16(src, 2)) {
              throw std::runtime_error("TMA load reads a NaN: a K/V slot the kernel must not read (past seq_len)");
            }
            std::memcpy(&bits, src, 2);
          }
          const uint32_t swizzled = at ^ (((at >> 7) & 7u) << 4);
          std::memcpy(const_cast<char*>(b.smem.data()) + (swizzled - kSharedBase), &bits, 2);
        }
}

inline uint64_t box_bytes(const TensorMap& m) { return uint64_t{m.box[0]} * m.box[1] * m.box[2] * m.box[3] * 2; }

inline void tma_load_4d(void* dst, const TensorMap* map, void* bar_ptr, int c0, int c1, int c2, int c3) {
  const Block& b = state();
  if (map == nullptr || !map->encoded) throw std::runtime_error("TMA load through a tensor map never encoded");
  const uint32_t dst_at = shared_address(dst);
  const uint64_t bytes = box_bytes(*map);
  // The kernels' swizzled stages start on 1024-byte boundaries (where the swizzle pattern starts).
  if ((dst_at % 1024) != 0) throw std::runtime_error("TMA load (128B swizzle) to shared memory not 1024-byte aligned");
  if (dst_at - kSharedBase + bytes > b.smem.size()) throw std::runtime_error("TMA load past the end of shared memory");
  MBarrier& bar = mbarrier_at(bar_ptr);
  const TmaOp op{dst_at, *map, {c0, c1, c2, c3}};
  if (land_at_issue()) {
    tma_land(op);
    bar.tx -= static_cast<int64_t>(bytes);
    complete_phase_if_done(bar);
    return;
  }
  bar.loads.push_back(op);
}

// mbarrier.try_wait.parity in a loop: returns once the phase with this parity has completed (the
// current phase's parity differs). The loads of the phase land at the first wait; a phase that
// cannot complete (arrivals or transaction bytes missing) is a hang, reported by run_block.
inline void mbarrier_wait(void* p, uint32_t parity) {
  MBarrier& bar = mbarrier_at(p);
  if ((bar.phase & 1) != (parity & 1)) return;
  const uint64_t phase = bar.phase;
  std::vector<TmaOp> loads = std::move(bar.loads);
  bar.loads.clear();
  for (const TmaOp& op : loads) {
    tma_land(op);
    bar.tx -= static_cast<int64_t>(box_bytes(op.map));
  }
  if (bar.pending == 0 && bar.tx < 0) {
    throw std::runtime_error("TMA loads landed more bytes than the mbarrier expected");
  }
  complete_phase_if_done(bar);
  while (mbarrier_at(p).phase == phase) yield();
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
  b.warpgroup_barriers.assign((threads + 127) / 128, Barrier{128});
  b.exchange.assign(b.warp_barriers.size() * 2 * 32, LaneSlot{});
  std::fill(b.smem.begin(), b.smem.end(), static_cast<char>(0xff));  // NaN in every float type
  b.mbarriers.clear();
  for (unsigned i = 0; i < threads; ++i) {
    Fiber& f = b.fibers[i];
    f.stack.resize(kStack);
    f.done = false;
    f.index = i;
    f.collectives = 0;
    f.groups.clear();
    f.open.clear();
    f.wg_groups.clear();
    f.wg_open.clear();
    f.wg_fenced = false;
    f.proxy_dirty = false;
    getcontext(&f.context);
    f.context.uc_stack.ss_sp = f.stack.data();
    f.context.uc_stack.ss_size = f.stack.size();
    f.context.uc_link = nullptr;
    makecontext(&f.context, fiber_entry, 0);
  }
  // Default: every thread in turn, so warps move in lockstep. With copies landing at issue, one
  // warp at a time runs as far as it can (to a block or warpgroup barrier) before the next starts:
  // the earliest warp then refills a buffer before the later ones have read it, if no barrier
  // stops it.
  const unsigned step = land_at_issue() ? 32u : threads;
  for (unsigned left = threads; left > 0;) {
    const uint64_t before = b.events;
    for (unsigned first = 0; first < threads; first += step) {
      uint64_t seen;
      do {
        seen = b.events;
        for (unsigned i = first; i < std::min(threads, first + step); ++i) {
          Fiber& f = b.fibers[i];
          if (f.done) continue;
          b.current = &f;
          swapcontext(&b.scheduler, &f.context);
          if (f.done) --left;
        }
      } while (step != threads && b.events != seen);
    }
    if (left > 0 && b.events == before) {
      if (!b.error.empty()) throw std::runtime_error(b.error);  // a thread failed; the rest wait for it
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
#ifndef __grid_constant__
#define __grid_constant__
#endif
#define threadIdx (::minengine::emu::thread_idx3())
#define blockIdx (::minengine::emu::state().block_idx)
#define blockDim (::minengine::emu::state().block)
#define gridDim (::minengine::emu::state().grid)
#define __syncthreads() ::minengine::emu::syncthreads()
#define __shfl_xor_sync(mask, value, offset) ::minengine::emu::shfl_xor((mask), (value), (offset))
#define __shfl_sync(mask, value, src) ::minengine::emu::shfl_idx((mask), (value), (src))
