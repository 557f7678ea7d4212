// paged_attention (contract: triton_kernels/attention.py): a mixed batch of prefill chunks and
// decodes in one launch over paged K/V caches. Two kernels:
//
// Tensor cores (fp16 / bf16; mma.sync m16n8k16, sm_80 and later, Hopper included).
//   Rows are (query token, query head) pairs of one sequence and one KV head, token-major, so the
//   `group` query heads that share a KV head fill the rows of a decode (GQA packing). Each warp owns
//   16 rows; Q stays in registers as mma A fragments; K/V tiles stream through shared memory with
//   cp.async (double-buffered where it fits) and reach B fragments by ldmatrix (.trans for V). Each
//   key's page is looked up in the block table, so any page size works: one thread per key and
//   K/V row, into shared memory an iteration before the copies (two stages ahead of the math;
//   lookup_key); keys past the causal limit, the split's range or seq_len are never read (the copy
//   zero-fills) and are masked to -inf: in every stage of the 64-row mma.sync tile, and elsewhere
//   only in stages that some row of the tile does not see whole (full_hi).
//   Online softmax in fp32 (log2 domain; in unmasked stages one FFMA and one ex2.approx per
//   weight); P is reused from the S accumulators as the A operand of P @ V.
//   One launch holds two tile shapes, POD-style: blocks [0, prefill_blocks) run 64-row tiles (4 warps
//   along rows sharing each 64-key tile) over sequences with more than 16 rows; the next num_seqs
//   blocks run one 16-row tile per remaining sequence (decodes and tiny chunks), its 4 warps
//   splitting the keys 4 ways and merging through shared memory; the last block of each (KV head,
//   split) zeroes its share of the padding rows past cu_seqlens_q[-1]. Prefill tiles find their
//   sequence by binary search: sequence b owns blocks [cu[b] * group / 64 + b, cu[b + 1] * group / 64
//   + b + 1), so the grid needs no device data. By default (block_order heavy-first) a sequence's
//   prefill tiles start last tile first and grid x interleaves up to 4 KV heads (block_kv_head).
//   Split-KV (grid z > 1) gives each split a contiguous range of key tiles; partial (acc, max, sum)
//   go to an fp32 workspace and merge_splits_kernel combines them (one more launch).
//   The wgmma variant (impl 3, sm_90a) runs the 64-row tiles on Hopper's warpgroup MMA instead
//   (wgmma_tile); everything else is shared. Impl 4 loads their K/V stages by TMA, impl 5 also
//   pipelines them (a stage's softmax under the previous stage's P V).
//
// CUDA cores (fp32, or unaligned K/V): one block per (query token, query head), 4 warps; each warp
// walks every 4th visible key with its lanes splitting the head dim, then the warps merge.
//
// Offsets into q, caches and out are 64-bit; accumulation is fp32.
#include <algorithm>
#include <cmath>
#include <iterator>

#include "common.cuh"
#include "kernels.h"
#if !defined(MINENGINE_EMULATE) && CUDART_VERSION >= 12000
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled
#endif

namespace minengine {

constexpr int kThreads = 128;  // 4 warps, both kernels
constexpr int kMaxHeadDim = 256;
constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

// ---- CUDA-core kernel --------------------------------------------------------------------------

constexpr int kSimtWarps = kThreads / 32;
constexpr int kPerLane = kMaxHeadDim / 32;

// Shared memory of the CUDA-core kernel: the sequence id, then per-warp max, sum and accumulators.
constexpr size_t kSimtSmem = 16 + sizeof(float) * kSimtWarps * (2 + kMaxHeadDim);

template <typename T>
__global__ void __launch_bounds__(kThreads)
    attention_simt_kernel(const T* __restrict__ q, const T* __restrict__ k_cache, const T* __restrict__ v_cache,
                          T* __restrict__ out, const int32_t* __restrict__ block_tables,
                          const int32_t* __restrict__ seq_lens, const int32_t* __restrict__ cu_seqlens_q, int num_seqs,
                          int group, int head_dim, FastDiv page_size, int64_t sq_t, int64_t sq_h, int64_t sk_p,
                          int64_t sk_s, int64_t sk_h, int64_t sv_p, int64_t sv_s, int64_t sv_h, int64_t so_t,
                          int64_t so_h, int64_t sbt, float scale) {
  ME_DYNAMIC_SMEM(smem);
  int* s_seq = reinterpret_cast<int*>(smem);
  float* s_max = reinterpret_cast<float*>(smem + 16);
  float* s_sum = s_max + kSimtWarps;
  float* s_acc = s_sum + kSimtWarps;  // [warp][kMaxHeadDim]
  const int token = blockIdx.x, head = blockIdx.y, kv_head = head / group;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

  if (threadIdx.x == 0) {  // the last b with cu[b] <= token; b == num_seqs: padding
    int lo = 0, hi = num_seqs;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (cu_seqlens_q[mid] <= token) lo = mid; else hi = mid - 1;
    }
    *s_seq = lo;
  }
  __syncthreads();
  const int seq = *s_seq;
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
  for (int j = warp; j < kv_end; j += kSimtWarps) {
    const int index = page_size.div(j);
    const int64_t page = table[index], slot = j - index * static_cast<int>(page_size.divisor);
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
    if (x < head_dim) s_acc[warp * kMaxHeadDim + x] = acc[i];
  }
  __syncthreads();
  float m_all = -INFINITY;
#pragma unroll
  for (int w = 0; w < kSimtWarps; ++w) m_all = fmaxf(m_all, s_max[w]);
  for (int x = threadIdx.x; x < head_dim; x += blockDim.x) {
    float total = 0.f, value = 0.f;
#pragma unroll
    for (int w = 0; w < kSimtWarps; ++w) {
      const float weight = s_max[w] == -INFINITY ? 0.f : expf(s_max[w] - m_all);
      total += weight * s_sum[w];
      value += weight * s_acc[w * kMaxHeadDim + x];
    }
    o[x] = from_float<T>(total > 0.f ? value / total : 0.f);
  }
}

// ---- tensor-core kernel ------------------------------------------------------------------------

struct MmaParams {
  TensorMap k_map, v_map;  // wgmma-tma: the caches as TMA maps (encode_kv_map); unused otherwise
  int tma_rows, tma_shift;  // wgmma-tma: slots a TMA box holds (min(page_size, 64)), and its log2
  const void* q;
  const void* k_cache;
  const void* v_cache;
  void* out;
  float* part_acc;  // [num_splits, num_tokens, Hq, head_dim] when num_splits > 1
  float* part_ml;   // [num_splits, num_tokens, Hq, 2]: running max (log2 domain) and sum
  const int32_t* block_tables;
  const int32_t* seq_lens;
  const int32_t* cu;
  int num_seqs, num_tokens, num_q_heads, group, head_dim, num_splits, prefill_blocks;
  int head_shift;    // grid x interleaves the blocks of 2^head_shift KV heads (block_kv_head)
  int tile_shift;    // a prefill tile's rows: 2^tile_shift (64; 128 for the two-warpgroup wgmma tile)
  bool heavy_first;  // a sequence's prefill tiles run last tile first (attention_mma_kernel)
  FastDiv page;  // page_size
  int64_t sq_t, sq_h, sk_p, sk_s, sk_h, sv_p, sv_s, sv_h, so_t, so_h, sbt;
  float scale_log2;  // |softmax_scale| * log2(e)
  uint32_t q_sign;   // 0x80008000 for a negative softmax_scale: Q's signs flipped (exact) as it loads
};

// Block order. Blocks start in the order of their linear index (grid x fastest), so the order of
// the grid is the order the SMs get work in. Grid x holds one KV head's blocks (its sequences'
// prefill tiles, then one decode tile per sequence, then the padding block) for 2^head_shift KV
// heads interleaved: x = i << head_shift | (kv head & (2^head_shift - 1)), y = kv head >> head_shift.
// With heavy_first, a sequence's prefill tiles go last tile first: the causal tiles that see the
// most keys start first and the lightest ones fill the end of the launch, where an SM would
// otherwise wait for one long tile (FlashAttention-2 reverses causal query blocks for the same
// reason); interleaving heads spreads each tile index over several heads before the next, lighter
// one, while keeping the blocks that read one head's K/V close in time (L2).
__host__ __device__ __forceinline__ int kv_head_of(const MmaParams& p, unsigned x, unsigned y) {
  return static_cast<int>((y << p.head_shift) | (x & ((1u << p.head_shift) - 1u)));
}
__device__ __forceinline__ int block_kv_head(const MmaParams& p) { return kv_head_of(p, blockIdx.x, blockIdx.y); }

// Tile shapes for a head dim padded to D (64, 128 or 256): keys per stage and pipeline depth of
// the prefill (4 warps x 16 rows) and decode (16 rows, 4 warps along keys) tiles, chosen so a
// block needs at most about 70 KB of shared memory (the two-warpgroup kernel's decode tiles take
// twice the keys a stage: 140 KB at D 128, one block an SM).
template <int D> struct MmaShape {
  static constexpr int kPrefillKeys = D > 128 ? 32 : 64, kPrefillStages = 2;
  static constexpr int kDecodeKeys = 64, kDecodeStages = D > 128 ? 1 : 2;
  static constexpr int kPitch = D + 8;  // shared-memory row pitch (elements): conflict-free fragments
};

// The wgmma prefill tile (sm_90a, D <= 128): 64 keys per stage, double-buffered (three buffers when
// pipelined: stage t - 1's V is read while t's K is and t + 1 lands), K and V stages in
// 128B-swizzled atoms, plus up to 1 KB to align the first atom to 1024 bytes.
constexpr int kWgmmaKeys = 64;
__host__ __device__ constexpr int wgmma_stages(bool pipe) { return pipe ? 3 : 2; }

template <typename T, int D, int KEYS, int STAGES> __host__ __device__ constexpr size_t kv_smem_bytes() {
  return static_cast<size_t>(2) * STAGES * KEYS * MmaShape<D>::kPitch * sizeof(T);
}

__host__ __device__ constexpr size_t max3(size_t a, size_t b, size_t c) {
  return a > b ? (a > c ? a : c) : (b > c ? b : c);
}

// Key offsets (lookup_key, store_key below): two stages of [keys][K, V] int64 entries, up to 64 keys
// a warpgroup (the two-warpgroup kernel's decode tiles take 128 keys a stage).
constexpr int kMaxStageKeys = 64;
__host__ __device__ constexpr int offset_entries(int wgs) { return 2 * 2 * kMaxStageKeys * wgs; }

// The K/V stages (or the decode tiles' merge buffers) from the start of shared memory, then the key
// offsets at mma_offsets_at. WGS warpgroups a block: the decode tiles' warps split WGS times as many
// keys a stage.
template <typename T, int D, bool WG, bool PIPE = false, int WGS = 1>
__host__ __device__ constexpr size_t mma_offsets_at() {
  constexpr size_t prefill = WG ? static_cast<size_t>(2) * wgmma_stages(PIPE) * kWgmmaKeys * D * sizeof(T) + 1024
                                : kv_smem_bytes<T, D, MmaShape<D>::kPrefillKeys, MmaShape<D>::kPrefillStages>();
  constexpr size_t decode = kv_smem_bytes<T, D, MmaShape<D>::kDecodeKeys * WGS, MmaShape<D>::kDecodeStages>();
  constexpr size_t merge = sizeof(float) * 4 * WGS * 16 * (D + 2);  // decode tiles: the warps' partials
  return (max3(prefill, decode, merge) + 15) / 16 * 16;
}
// wgmma-tma tiles also keep, after the key offsets, two stages' page ids of their TMA chunks (-1:
// the chunk comes by cp.async) and the stage buffers' mbarriers.
constexpr int kMaxTmaChunks = 8;  // 64 keys in chunks of at least 8 slots
constexpr size_t tma_bytes(int stages) { return sizeof(int32_t) * 2 * kMaxTmaChunks + sizeof(uint64_t) * stages; }
template <typename T, int D, bool WG, bool TMA = false, bool PIPE = false, int WGS = 1>
constexpr size_t mma_smem_bytes() {
  return mma_offsets_at<T, D, WG, PIPE, WGS>() + sizeof(int64_t) * offset_entries(WGS) +
         (TMA ? tma_bytes(wgmma_stages(PIPE)) : 0);
}

// The rows and keys of one tile of BM rows of sequence `seq`, starting at row tile * BM, and the two
// rows of this thread: r = row0 + wm * 16 + g (+ 8).
// Keys [0, full_hi) are seen by every row of the tile (the first row's causal limit, the split's end):
// stages below it need no mask.
struct TileRows {
  int q_start, n_rows, row0, key_hi, full_hi, stage_lo, stage_hi;
  int pos[2], tok[2], head[2];  // query position (-1: an invalid row, which sees no key), token, head
  bool valid[2];
};

// False when the tile is past the sequence's rows (the whole block returns).
template <int BM, int KEYS>
__device__ __forceinline__ bool tile_rows(const MmaParams& p, int seq, int tile, int wm, int g, TileRows& r) {
  const int kv_head = block_kv_head(p), split = blockIdx.z;
  r.q_start = p.cu[seq];
  const int q_len = p.cu[seq + 1] - r.q_start;
  r.n_rows = q_len * p.group, r.row0 = tile * BM;
  if (r.row0 >= r.n_rows) return false;
  const int ctx = p.seq_lens[seq] - q_len;  // position of the sequence's first query token
  const int last_row = (r.row0 + BM < r.n_rows ? r.row0 + BM : r.n_rows) - 1;
  const int kv_end = ctx + last_row / p.group + 1;  // keys any row of the tile sees
  const int num_stages = (kv_end + KEYS - 1) / KEYS;
  const int per_split = (num_stages + p.num_splits - 1) / p.num_splits;
  r.stage_lo = split * per_split;
  r.stage_hi = r.stage_lo + per_split < num_stages ? r.stage_lo + per_split : num_stages;
  r.key_hi = r.stage_hi * KEYS < kv_end ? r.stage_hi * KEYS : kv_end;
  const int first_sees = ctx + r.row0 / p.group + 1;
  r.full_hi = first_sees < r.key_hi ? first_sees : r.key_hi;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int row = r.row0 + wm * 16 + g + 8 * i;
    r.valid[i] = row < r.n_rows;
    r.tok[i] = r.q_start + (r.valid[i] ? row / p.group : 0);
    r.head[i] = kv_head * p.group + (r.valid[i] ? row % p.group : 0);
    r.pos[i] = r.valid[i] ? ctx + row / p.group : -1;
  }
  return true;
}

// The start of a tile: Q of this thread's rows as mma A fragments (the same layout serves mma.sync
// and wgmma; signs flipped for a negative scale), zero accumulators, running max -inf and sum 0.
template <typename T, int D>
__device__ __forceinline__ void start_tile(const MmaParams& p, const TileRows& r, int t, uint32_t qf[D / 16][4],
                                           float acc[D / 8][4], float m[2], float l[2]) {
#pragma unroll
  for (int dn = 0; dn < D / 8; ++dn) acc[dn][0] = acc[dn][1] = acc[dn][2] = acc[dn][3] = 0.f;
  m[0] = m[1] = -INFINITY;
  l[0] = l[1] = 0.f;
  const T* q = static_cast<const T*>(p.q);
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int i = j & 1, d = kk * 16 + 2 * t + (j >= 2 ? 8 : 0);
      qf[kk][j] = 0u;
      if (r.valid[i] && d < p.head_dim) {
        qf[kk][j] = p.q_sign ^ *reinterpret_cast<const uint32_t*>(q + static_cast<int64_t>(r.tok[i]) * p.sq_t +
                                                                  static_cast<int64_t>(r.head[i]) * p.sq_h + d);
      }
    }
  }
}

// Where the keys of a stage live, looked up an iteration before their copies are issued (two stages
// ahead of the math). Entry e of a stage is the element offset, from the KV head's base, of key
// stage * KEYS + e / 2's K row (e even) or V row (e odd), or -1 for a key at or past key_hi (not
// read). Thread e computes entry e in two steps: lookup_key issues its block-table read (keys past
// key_hi read nothing), store_key writes the entry once the read has landed; between them the tile
// computes a stage, which hides the read's latency. The copies then read their rows' offsets from
// shared memory: one table read per key and K/V row instead of one per 16-byte chunk, and no
// global load in front of the copies.
// The -1 sentinel relies on offsets >= 0: page ids are (the contract; MINENGINE_KERNEL_DEBUG checks
// them) and so are the strides, which come from torch tensors.
struct KeyLookup {
  int page = -1, slot = 0;  // page -1: no entry here or the key is past key_hi
};

template <int KEYS, int THREADS>
__device__ __forceinline__ KeyLookup lookup_key(const MmaParams& p, const int32_t* table, int stage, int key_hi) {
  static_assert(2 * KEYS <= THREADS && KEYS <= kMaxStageKeys * (THREADS / 128), "one entry per thread");
  KeyLookup k;
  const int key = stage * KEYS + static_cast<int>(threadIdx.x) / 2;
  if (threadIdx.x < 2 * KEYS && key < key_hi) {
    const int index = p.page.div(key);
    k.page = table[index];
    k.slot = key - index * static_cast<int>(p.page.divisor);
  }
  return k;
}

template <int KEYS>
__device__ __forceinline__ void store_key(const MmaParams& p, const KeyLookup& k, int64_t* offsets) {
  if (threadIdx.x >= 2 * KEYS) return;
  const bool v = threadIdx.x & 1;
  offsets[threadIdx.x] = k.page < 0 ? -1
                                    : static_cast<int64_t>(k.page) * (v ? p.sv_p : p.sk_p) +
                                          static_cast<int64_t>(k.slot) * (v ? p.sv_s : p.sk_s);
}

// wgmma-tma: the offset entry of a key whose rows a TMA load brings (store_key_tma).
constexpr int64_t kByTma = -2;

// K/V rows [stage * KEYS, + KEYS) into shared memory from their offsets (store_key), the 16-byte
// chunk (row, c) at element offset place(row, c) of ks and vs. Thread i copies chunk i % CHUNKS of
// rows i / CHUNKS + j * ROWS. Keys with offset -1 are zero-filled without a read; chunks past
// head_dim are skipped (ZERO_PAD false: never read back) or zero-filled (ZERO_PAD true: read by
// whole 64-dim wgmma operands). SKIP_TMA: rows with offset kByTma are left to their TMA load.
template <typename T, int D, int KEYS, bool ZERO_PAD, typename Place, int THREADS, bool SKIP_TMA = false>
__device__ __forceinline__ void load_kv_stage(const MmaParams& p, const int64_t* offsets, T* ks, T* vs, Place place) {
  constexpr int CHUNKS = D / 8, ROWS = THREADS / CHUNKS;
  static_assert(THREADS % CHUNKS == 0 && KEYS % ROWS == 0, "whole rows per pass, whole passes per stage");
  const int c = threadIdx.x % CHUNKS, row0 = threadIdx.x / CHUNKS;
  const bool in_dim = c * 8 < p.head_dim;
  if (!ZERO_PAD && !in_dim) return;
  const int64_t kv_head = block_kv_head(p);
  const T* k_head = static_cast<const T*>(p.k_cache) + kv_head * p.sk_h + c * 8;
  const T* v_head = static_cast<const T*>(p.v_cache) + kv_head * p.sv_h + c * 8;
  const longlong2* pairs = reinterpret_cast<const longlong2*>(offsets);
#pragma unroll
  for (int j = 0; j < KEYS / ROWS; ++j) {
    const int row = row0 + j * ROWS;
    const longlong2 at_kv = pairs[row];
    if (SKIP_TMA && at_kv.x == kByTma) continue;
    const bool live = in_dim && at_kv.x >= 0;
    const int at = place(row, c);
    cp_async_16(ks + at, live ? k_head + at_kv.x : k_head, live ? 16 : 0);
    cp_async_16(vs + at, live ? v_head + at_kv.y : v_head, live ? 16 : 0);
  }
}

// Where load_kv_stage puts the 16-byte chunk c of row `row` (element offsets). RowMajor: rows of
// `pitch` elements (mma.sync tiles). Swizzle128: [D / 64][keys][64], each 128-byte row's chunks
// XORed with the row index, the wgmma 128B-swizzle layout.
template <int PITCH> struct RowMajor {
  __device__ __forceinline__ int operator()(int row, int c) const { return row * PITCH + c * 8; }
};
template <int KEYS> struct Swizzle128 {
  __device__ __forceinline__ int operator()(int row, int c) const {
    return (c / 8) * KEYS * 64 + row * 64 + ((c % 8) ^ (row % 8)) * 8;
  }
};

// The online-softmax update of this thread's two rows over S (NT 8-key tiles starting at key0, in the
// mma accumulator layout): S becomes P, acc and l are rescaled. m is the running max in the log2
// domain (of scale_log2 * S), so each weight is one FFMA and one ex2: 2^(S scale_log2 - m), with
// scale_log2 >= 0 (start_tile folds a negative scale into Q's sign). MASKED: keys at or past key_hi
// or after a row's position weigh 0; without it every key counts (stages below full_hi).
// DEFER (the pipelined wgmma tile, whose acc is still a P V's accumulator): acc is left alone and
// the rows' rescale factors go to alpha instead.
template <int NT, int ND, bool MASKED, bool DEFER = false>
__device__ __forceinline__ void online_softmax(const MmaParams& p, const TileRows& r, int key0, int t, float s[NT][4],
                                               float acc[ND][4], float m[2], float l[2], float* alpha_out = nullptr) {
  if constexpr (MASKED) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int key = key0 + nt * 8 + 2 * t + (j & 1);
        if (!(key < r.key_hi && key <= r.pos[j >> 1])) s[nt][j] = -INFINITY;
      }
    }
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    float mx = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * i], s[nt][2 * i + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    // fmaxf drops a NaN: mx * scale_log2 is one for a row with no key here under a zero scale
    const float m_new = fmaxf(m[i], mx * p.scale_log2);
    const float base = m_new == -INFINITY ? 0.f : m_new;
    const float alpha = fast_exp2(m[i] - base);
    m[i] = m_new;
    l[i] *= alpha;
    if constexpr (DEFER) {
      alpha_out[i] = alpha;
    } else {
#pragma unroll
      for (int dn = 0; dn < ND; ++dn) {
        acc[dn][2 * i] *= alpha;
        acc[dn][2 * i + 1] *= alpha;
      }
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int j = 2 * i; j < 2 * i + 2; ++j) {
        const float w = fast_exp2(fmaf(s[nt][j], p.scale_log2, -base));
        s[nt][j] = MASKED && s[nt][j] == -INFINITY ? 0.f : w;  // -inf * 0 (a zero scale) is NaN
        l[i] += s[nt][j];
      }
    }
  }
}

// online_softmax without masks for stages every row sees whole (key0 + KW <= full_hi), else with.
template <int NT, int ND, bool DEFER = false>
__device__ __forceinline__ void softmax_stage(const MmaParams& p, const TileRows& r, int key0, int t, float s[NT][4],
                                              float acc[ND][4], float m[2], float l[2], float* alpha = nullptr) {
  if (key0 + NT * 8 <= r.full_hi) {
    online_softmax<NT, ND, false, DEFER>(p, r, key0, t, s, acc, m, l, alpha);
  } else {
    online_softmax<NT, ND, true, DEFER>(p, r, key0, t, s, acc, m, l, alpha);
  }
}

// P of 16 keys (two 8-key accumulator tiles) as an mma A fragment.
template <typename T> __device__ __forceinline__ void p_fragment(const float s0[4], const float s1[4], uint32_t a[4]) {
  a[0] = pack2<T>(s0[0], s0[1]), a[1] = pack2<T>(s0[2], s0[3]);
  a[2] = pack2<T>(s1[0], s1[1]), a[3] = pack2<T>(s1[2], s1[3]);
}

__device__ __forceinline__ void quad_sum(float l[2]) {  // the 4 threads of a quad share a row
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
  }
}

// Index of (split, token, head) in the split workspace.
__device__ __forceinline__ int64_t workspace_row(const MmaParams& p, int token, int head) {
  return (static_cast<int64_t>(blockIdx.z) * p.num_tokens + token) * p.num_q_heads + head;
}

// Writes this thread's two whole rows (quad-summed l): to out, or as partials to the workspace.
template <typename T, int D>
__device__ __forceinline__ void store_rows(const MmaParams& p, const TileRows& r, int t, float acc[D / 8][4],
                                           const float m[2], const float l[2]) {
  T* out = static_cast<T*>(p.out);
  const bool partial = p.num_splits > 1;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    if (!r.valid[i]) continue;
    // The row's token and head again, as tile_rows found them (wm = warp: these tiles' warps hold
    // whole rows), rather than kept in registers through the loop.
    const int row = r.row0 + static_cast<int>(threadIdx.x >> 5) * 16 + static_cast<int>(threadIdx.x & 31) / 4 + 8 * i;
    const int tok = r.q_start + row / p.group, head = block_kv_head(p) * p.group + row % p.group;
    const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;
    const int64_t w = workspace_row(p, tok, head);
    T* o = out + static_cast<int64_t>(tok) * p.so_t + static_cast<int64_t>(head) * p.so_h;
#pragma unroll
    for (int dn = 0; dn < D / 8; ++dn) {
      const int d = dn * 8 + 2 * t;
      if (d >= p.head_dim) break;
      if (partial) {
        p.part_acc[w * p.head_dim + d] = acc[dn][2 * i];
        p.part_acc[w * p.head_dim + d + 1] = acc[dn][2 * i + 1];
      } else {
        o[d] = from_float<T>(acc[dn][2 * i] * inv);
        o[d + 1] = from_float<T>(acc[dn][2 * i + 1] * inv);
      }
    }
    if (partial && t == 0) {
      p.part_ml[w * 2] = m[i];
      p.part_ml[w * 2 + 1] = l[i];
    }
  }
}

// A tile's key offsets: two stages' entries in shared memory, the stage's parity from stage_lo
// choosing the half.
template <int KEYS> struct StageOffsets {
  int64_t* base;
  int stage_lo;
  __device__ __forceinline__ int64_t* of(int stage) const { return base + ((stage - stage_lo) & 1) * 2 * KEYS; }
};

// The key offsets of a tile's first two stages (the loop then stores each stage's two ahead), published
// by a barrier before the first copy reads them. store(lookup, stage) writes a stage's entries.
template <int KEYS, int THREADS, typename Store>
__device__ __forceinline__ void start_offsets(const MmaParams& p, const int32_t* table, const TileRows& r,
                                              const StageOffsets<KEYS>& offsets, Store store) {
#ifdef MINENGINE_EMULATE
  // The emulator fills shared memory with 0xff bytes, which read as offset -1 (skip the key): poison
  // the entries with an offset far outside the caches first, so a copy that reads one before it is
  // published fails the emulator's bounds check instead of silently zero-filling.
  if (threadIdx.x < 2 * KEYS) {
    offsets.of(r.stage_lo)[threadIdx.x] = int64_t{1} << 40;
    offsets.of(r.stage_lo + 1)[threadIdx.x] = int64_t{1} << 40;
  }
  __syncthreads();
#endif
  const KeyLookup first = lookup_key<KEYS, THREADS>(p, table, r.stage_lo, r.key_hi);
  const KeyLookup second = lookup_key<KEYS, THREADS>(p, table, r.stage_lo + 1, r.key_hi);
  store(first, r.stage_lo);
  store(second, r.stage_lo + 1);
  __syncthreads();
}

// One tile of BM = 16 * WM rows of sequence `seq` on mma.sync; WN warps split each stage's KEYS
// keys (WM * WN warps: the block's).
template <typename T, int D, int WM, int WN, int KEYS, int STAGES>
__device__ __forceinline__ void mma_tile(const MmaParams& p, char* smem, int64_t* offsets, int seq, int tile) {
  constexpr int BM = 16 * WM, KW = KEYS / WN, LD = MmaShape<D>::kPitch, THREADS = 32 * WM * WN;
  static_assert(KW % 16 == 0, "tile shape");
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int wm = warp / WN, wn = warp % WN, g = lane >> 2, t = lane & 3;
  TileRows r;
  if (!tile_rows<BM, KEYS>(p, seq, tile, wm, g, r)) return;
  uint32_t qf[D / 16][4];
  float acc[D / 8][4], m[2], l[2];
  start_tile<T, D>(p, r, t, qf, acc, m, l);

  T* ks = reinterpret_cast<T*>(smem);  // [STAGES][KEYS][LD]
  T* vs = ks + STAGES * KEYS * LD;
  const int32_t* table = p.block_tables + static_cast<int64_t>(seq) * p.sbt;
  const StageOffsets<KEYS> stage_offsets{offsets, r.stage_lo};
  auto load_stage = [&](int stage, int buf) {
    load_kv_stage<T, D, KEYS, false, RowMajor<LD>, THREADS>(p, stage_offsets.of(stage), ks + buf * KEYS * LD,
                                                            vs + buf * KEYS * LD, RowMajor<LD>{});
  };

  auto store = [&](const KeyLookup& k, int stage) { store_key<KEYS>(p, k, stage_offsets.of(stage)); };
  start_offsets<KEYS, THREADS>(p, table, r, stage_offsets, store);
  if (r.stage_lo < r.stage_hi) load_stage(r.stage_lo, 0);
  cp_async_commit();
  for (int stage = r.stage_lo; stage < r.stage_hi; ++stage) {
    const int buf = (stage - r.stage_lo) % STAGES;
    const KeyLookup ahead = lookup_key<KEYS, THREADS>(p, table, stage + 2, r.key_hi);
    if (STAGES > 1) {
      if (stage + 1 < r.stage_hi) load_stage(stage + 1, (buf + 1) % STAGES);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();

    // S = Q K^T for this warp's KW keys.
    const T* kt = ks + (buf * KEYS + wn * KW) * LD;
    const T* vt = vs + (buf * KEYS + wn * KW) * LD;
    float s[KW / 8][4];
#pragma unroll
    for (int nt = 0; nt < KW / 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      if (kk * 16 >= p.head_dim) break;
#pragma unroll
      for (int nt = 0; nt < KW / 8; nt += 2) {  // one ldmatrix: B of key tiles nt and nt + 1
        uint32_t b[4];
        ldmatrix_x4<false>(b, kt + (nt * 8 + lane % 8 + lane / 16 * 8) * LD + kk * 16 + (lane / 8) % 2 * 8);
        const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
        mma_16816<T>(s[nt], qf[kk], b0);
        mma_16816<T>(s[nt + 1], qf[kk], b1);
      }
    }
    if constexpr (WN == 1) {  // 64-row tiles mask every stage: the branch costs 12 registers (D 128: 180 > 168)
      online_softmax<KW / 8, D / 8, true>(p, r, stage * KEYS, t, s, acc, m, l);
    } else {
      softmax_stage<KW / 8, D / 8>(p, r, stage * KEYS + wn * KW, t, s, acc, m, l);
    }

    // O += P V: P's accumulators become A fragments (16 keys = two 8-key tiles).
#pragma unroll
    for (int kc = 0; kc < KW / 16; ++kc) {
      uint32_t a[4];
      p_fragment<T>(s[2 * kc], s[2 * kc + 1], a);
#pragma unroll
      for (int dn = 0; dn < D / 8; dn += 2) {  // one transposing ldmatrix: B of dim tiles dn and dn + 1
        if (dn * 8 >= p.head_dim) break;    // head_dim % 16 == 0: both or neither
        uint32_t b[4];
        ldmatrix_x4<true>(b, vt + (kc * 16 + lane % 16) * LD + dn * 8 + lane / 16 * 8);
        const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
        mma_16816<T>(acc[dn], a, b0);
        mma_16816<T>(acc[dn + 1], a, b1);
      }
    }
    store(ahead, stage + 2);  // stage's own entries are read: reuse them
    __syncthreads();          // the buffer is refilled next; the entries are published
    if (STAGES == 1 && stage + 1 < r.stage_hi) {
      load_stage(stage + 1, 0);
      cp_async_commit();
    }
  }
  quad_sum(l);
  if (WN == 1) {  // each warp holds whole rows: write them
    store_rows<T, D>(p, r, t, acc, m, l);
    return;
  }

  // WN warps hold the same 16 rows over different keys: merge them through shared memory.
  float* red_ml = reinterpret_cast<float*>(smem);  // [WN][16][2]
  float* red_acc = red_ml + WN * 16 * 2;           // [WN][16][D]
  __syncthreads();                                 // all warps are done with the K/V buffers
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int row = g + 8 * i;
    if (t == 0) {
      red_ml[(wn * 16 + row) * 2] = m[i];
      red_ml[(wn * 16 + row) * 2 + 1] = l[i];
    }
#pragma unroll
    for (int dn = 0; dn < D / 8; ++dn) {
      const int d = dn * 8 + 2 * t;
      if (d >= p.head_dim) break;
      red_acc[(wn * 16 + row) * D + d] = acc[dn][2 * i];
      red_acc[(wn * 16 + row) * D + d + 1] = acc[dn][2 * i + 1];
    }
  }
  __syncthreads();
  T* out = static_cast<T*>(p.out);
  const int kv_head = block_kv_head(p);
  for (int idx = threadIdx.x; idx < 16 * p.head_dim; idx += THREADS) {
    const int rr = idx / p.head_dim, d = idx % p.head_dim, row = r.row0 + rr;
    if (row >= r.n_rows) continue;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < WN; ++w) mx = fmaxf(mx, red_ml[(w * 16 + rr) * 2]);
    const float base = mx == -INFINITY ? 0.f : mx;
    float sum = 0.f, value = 0.f;
#pragma unroll
    for (int w = 0; w < WN; ++w) {
      const float weight = exp2f(red_ml[(w * 16 + rr) * 2] - base);
      sum += weight * red_ml[(w * 16 + rr) * 2 + 1];
      value += weight * red_acc[(w * 16 + rr) * D + d];
    }
    const int token = r.q_start + row / p.group, h = kv_head * p.group + row % p.group;
    if (p.num_splits > 1) {
      const int64_t w = workspace_row(p, token, h);
      p.part_acc[w * p.head_dim + d] = value;
      if (d == 0) {
        p.part_ml[w * 2] = mx;
        p.part_ml[w * 2 + 1] = sum;
      }
    } else {
      out[static_cast<int64_t>(token) * p.so_t + static_cast<int64_t>(h) * p.so_h + d] =
          from_float<T>(sum > 0.f ? value / sum : 0.f);
    }
  }
}

// wgmma-tma: a stage's keys come in chunks of p.tma_rows slots of one page (a power of two: the
// page size, or 64 where pages hold a multiple of 64 slots). A chunk that starts before key_hi and
// ends at or before seq_len (every slot a written cache row) comes by TMA, one box per 64 dims of K
// and of V; the rest (the chunk holding seq_len, chunks past key_hi) is copied key by key with
// cp.async as in the cp.async tile, zero-filling what must not be read. Chunks start at multiples
// of tma_rows, so the TMA chunks are those starting below tma_hi = min(key_hi, seq_len & -tma_rows).
// store_key_tma writes a key's offset entry (kByTma in TMA chunks) and, from a chunk's first key,
// the chunk's page id (-1: by cp.async).
template <int KEYS>
__device__ __forceinline__ void store_key_tma(const MmaParams& p, const KeyLookup& k, int stage, int tma_hi,
                                              int64_t* offsets, int32_t* pages) {
  if (threadIdx.x >= 2 * KEYS) return;
  const int key = stage * KEYS + static_cast<int>(threadIdx.x) / 2, first = key & -p.tma_rows;
  const bool tma = first < tma_hi;  // below key_hi: k.page was read
  if (tma) {
    offsets[threadIdx.x] = kByTma;
  } else {
    store_key<KEYS>(p, k, offsets);
  }
  if (key == first && (threadIdx.x & 1) == 0) pages[(key - stage * KEYS) >> p.tma_shift] = tma ? k.page : -1;
}

// wgmma-tma, every thread: each warp issues its TMA chunks' loads (j = warp, warp + WARPS, ...; the warps
// share the issue work) into the [D / 64][KEYS][64] swizzled buffers (chunk j at row j * tma_rows,
// 1024-byte aligned as the swizzle pattern needs: tma_rows >= 8), then arrives on the stage
// buffer's mbarrier (one arrival a warp) expecting their bytes; the barrier's transaction count may
// dip below zero until then. The warp index and page ids are shuffled from lane 0, so the compiler
// keeps the loads' operands in uniform registers and one elected lane issues each load, instead of
// a loop over the lanes' distinct operands per load.
template <typename T, int D, int THREADS>
__device__ __forceinline__ void issue_tma_chunks(const MmaParams& p, const int32_t* pages, T* ks, T* vs, uint64_t* bar,
                                                 int stage) {
  constexpr int KEYS = kWgmmaKeys, WARPS = THREADS / 32;
  const int rows = p.tma_rows, kv_head = block_kv_head(p);
  const int warp = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) >> 5, 0);
  const bool leader = elect_one();
  uint32_t bytes = 0;
  for (int j = warp; j < KEYS >> p.tma_shift; j += WARPS) {
    const int page = __shfl_sync(0xffffffffu, pages[j], 0);
    if (page < 0) continue;
    const int key = stage * KEYS + j * rows;
    const int slot = key - p.page.div(key) * static_cast<int>(p.page.divisor);  // 0 unless pages exceed 64 slots
    if (leader) {
#pragma unroll
      for (int a = 0; a < D / 64; ++a) {
        const int at = (a * KEYS + j * rows) * 64;
        tma_load_4d(ks + at, &p.k_map, bar, a * 64, slot, kv_head, page);
        tma_load_4d(vs + at, &p.v_map, bar, a * 64, slot, kv_head, page);
      }
    }
    bytes += 2u * (D / 64) * rows * 128u;
  }
  if (leader) mbarrier_arrive_expect_tx(bar, bytes);  // a stage without TMA chunks completes with the arrivals
}

// One prefill tile of 64 rows a warpgroup on Hopper's warpgroup MMA: WGS warpgroups (the block's
// warps, 4 each) take rows [64 w, 64 w + 64) of a 64 * WGS-row tile and read the same K/V stages.
// K/V stages are stored as [D / 64][KEYS][64] with 128-byte rows whose 16-byte chunks are XORed
// with the row index (the 128B-swizzle layout), which makes them wgmma B operands: K-major for
// S = Q K^T (K rows), N-major (transposed) for O += P V. Q and P stay in registers as A operands;
// each stage issues D / 16 wgmmas of N = 64 keys for S and 4 of N = D dims for P V, waiting for each
// group before the softmax reads S or the next stage rescales O.
// TMA: K/V stages by TMA where whole chunks of pages allow (store_key_tma), completing on an mbarrier
// per stage buffer.
// PIPE (FA3's intra-warpgroup overlap): stage t's S and stage t - 1's P V are issued together, and
// the softmax of S runs while the P V does, so the tensor cores have work through it; O is rescaled
// once the P V is in. Three stage buffers (t + 1 lands while t's K and t - 1's V are read), P of the
// previous stage held in registers: about 30 more registers, two blocks an SM of one warpgroup.
// WGS 2 (wgmma-2wg, TMA and PIPE): 128-row tiles, so each key crosses from L2 to shared memory once
// for 128 rows instead of 64; one block an SM.
template <typename T, int D, bool TMA, bool PIPE, int WGS = 1>
__device__ __forceinline__ void wgmma_tile(const MmaParams& p, char* smem, int64_t* offsets, int seq, int tile) {
  constexpr int KEYS = kWgmmaKeys, STAGES = wgmma_stages(PIPE), THREADS = 128 * WGS;
  constexpr uint32_t ATOMS = KEYS * 128, STAGE_BYTES = ATOMS * (D / 64);  // bytes per 64-dim block, per stage
  static_assert(D % 64 == 0 && D <= 128, "wgmma tile head dims");
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  TileRows r;
  if (!tile_rows<64 * WGS, KEYS>(p, seq, tile, warp, g, r)) return;
  uint32_t qf[D / 16][4];
  float acc[D / 8][4], m[2], l[2];
  start_tile<T, D>(p, r, t, qf, acc, m, l);

  T* ks = reinterpret_cast<T*>(smem + ((1024u - (smem_address(smem) & 1023u)) & 1023u));  // [STAGES][D/64][KEYS][64]
  T* vs = ks + STAGES * STAGE_BYTES / sizeof(T);
  // Descriptors of stage buffer 0's first K and V operands; the others are these plus a byte offset.
  const uint64_t k_desc0 = sw128_descriptor(smem_address(ks), 16, 1024);
  const uint64_t v_desc0 = sw128_descriptor(smem_address(vs), ATOMS, 1024);
  const int32_t* table = p.block_tables + static_cast<int64_t>(seq) * p.sbt;
  const StageOffsets<KEYS> stage_offsets{offsets, r.stage_lo};
  int32_t* pages = reinterpret_cast<int32_t*>(offsets + offset_entries(WGS));  // [2][kMaxTmaChunks] (TMA)
  uint64_t* bars = reinterpret_cast<uint64_t*>(pages + 2 * kMaxTmaChunks);       // [STAGES] (TMA)
  auto pages_of = [&](int stage) { return pages + ((stage - r.stage_lo) & 1) * kMaxTmaChunks; };
  const int whole = TMA ? p.seq_lens[seq] & -p.tma_rows : 0;  // seq_len rounded down to a chunk
  const int tma_hi = whole < r.key_hi ? whole : r.key_hi;
  auto store = [&](const KeyLookup& k, int stage) {
    if constexpr (TMA) {
      store_key_tma<KEYS>(p, k, stage, tma_hi, stage_offsets.of(stage), pages_of(stage));
    } else {
      store_key<KEYS>(p, k, stage_offsets.of(stage));
    }
  };
  auto load_stage = [&](int stage, int buf) {
    const int at = buf * STAGE_BYTES / sizeof(T);
    if constexpr (TMA) {
      issue_tma_chunks<T, D, THREADS>(p, pages_of(stage), ks + at, vs + at, &bars[buf], stage);
      if ((stage + 1) * KEYS - p.tma_rows < tma_hi) return;  // every chunk by TMA (store_key_tma)
    }
    load_kv_stage<T, D, KEYS, true, Swizzle128<KEYS>, THREADS, TMA>(p, stage_offsets.of(stage), ks + at, vs + at,
                                                                    Swizzle128<KEYS>{});
  };

  if constexpr (TMA) {
    if (threadIdx.x == 0) {  // an arrival a warp (issue_tma_chunks); published by start_offsets' barrier
      prefetch_tensor_map(&p.k_map);
      prefetch_tensor_map(&p.v_map);
#pragma unroll
      for (int b = 0; b < STAGES; ++b) mbarrier_init(&bars[b], THREADS / 32);
    }
  }
  // S = Q K^T of the stage in buffer buf: k-step kk reads dims [16 kk, 16 kk + 16) of all 64 keys
  // (32 bytes into the atom row); the first overwrites S (scale-d 0), so S needs no zero fill.
  auto issue_s = [&](float s[KEYS / 8][4], int buf) {
    const uint64_t k_stage = descriptor_plus(k_desc0, buf * STAGE_BYTES);
    fence_registers<D / 4>(&qf[0][0]);
    wgmma_fence();
    wgmma_m64k16<T, KEYS, 0, false>(&s[0][0], qf[0], k_stage);
#pragma unroll
    for (int kk = 1; kk < D / 16; ++kk) {  // dims past head_dim are zeros in Q and K
      wgmma_m64k16<T, KEYS, 0, true>(&s[0][0], qf[kk], descriptor_plus(k_stage, (kk / 4) * ATOMS + (kk % 4) * 32));
    }
    wgmma_commit();
  };
  // O += P V of the stage in buffer buf: k-step kc reads keys [16 kc, 16 kc + 16) of all D dims,
  // N-major: 64-dim atoms LBO apart, 8-key row groups SBO apart.
  auto issue_pv = [&](uint32_t pf[KEYS / 16][4], int buf) {
    const uint64_t v_stage = descriptor_plus(v_desc0, buf * STAGE_BYTES);
    fence_registers<KEYS / 4>(&pf[0][0]);
    fence_registers<D / 2>(&acc[0][0]);
    wgmma_fence();
#pragma unroll
    for (int kc = 0; kc < KEYS / 16; ++kc) {
      wgmma_m64k16<T, D, 1, true>(&acc[0][0], pf[kc], descriptor_plus(v_stage, kc * 16 * 128));
    }
    wgmma_commit();
  };
  // Stage `stage` in buffer buf, landed and visible to wgmma; the next stage's copies issued first.
  auto wait_stage = [&](int stage, int buf, int next_buf, uint32_t phase) {
    if (stage + 1 < r.stage_hi) load_stage(stage + 1, next_buf);
    cp_async_commit();
    cp_async_wait<1>();
    // The buffer's TMA loads: its n-th fill completes phase n (parity n & 1).
    if constexpr (TMA) mbarrier_wait(&bars[buf], phase);
    fence_proxy_async();  // the landed copies, to the async proxy wgmma reads through
    __syncthreads();
  };

  start_offsets<KEYS, THREADS>(p, table, r, stage_offsets, store);
  if (r.stage_lo < r.stage_hi) load_stage(r.stage_lo, 0);
  cp_async_commit();
  if constexpr (PIPE) {
    uint32_t pf[KEYS / 16][4];  // the previous stage's P, until its P V is issued
    int buf = 0, prev = STAGES - 1;
    uint32_t phase = 0;
    for (int stage = r.stage_lo; stage < r.stage_hi; ++stage) {
      const int next = buf + 1 == STAGES ? 0 : buf + 1;
      const KeyLookup ahead = lookup_key<KEYS, THREADS>(p, table, stage + 2, r.key_hi);
      wait_stage(stage, buf, next, phase);
      float s[KEYS / 8][4], alpha[2];
      issue_s(s, buf);
      if (stage > r.stage_lo) {  // P V of the stage before, in flight through this stage's softmax
        issue_pv(pf, prev);
        wgmma_wait<1>();
      } else {
        wgmma_wait<0>();
      }
      fence_registers<KEYS / 2>(&s[0][0]);  // S is read only after the wait
      softmax_stage<KEYS / 8, D / 8, true>(p, r, stage * KEYS, t, s, acc, m, l, alpha);
      wgmma_wait<0>();  // the P V: O and its P registers are free
      fence_registers<D / 2>(&acc[0][0]);
      fence_registers<KEYS / 2>(&s[0][0]);  // P is packed into pf only after the wait
#pragma unroll
      for (int dn = 0; dn < D / 8; ++dn) {
        acc[dn][0] *= alpha[0], acc[dn][1] *= alpha[0];
        acc[dn][2] *= alpha[1], acc[dn][3] *= alpha[1];
      }
#pragma unroll
      for (int kc = 0; kc < KEYS / 16; ++kc) p_fragment<T>(s[2 * kc], s[2 * kc + 1], pf[kc]);
      store(ahead, stage + 2);  // stage's own entries are read: reuse them
      __syncthreads();          // the buffer after next is refilled next; the entries are published
      prev = buf, buf = next;
      if (buf == 0) phase ^= 1u;
    }
    if (r.stage_lo < r.stage_hi) {
      issue_pv(pf, prev);
      wgmma_wait<0>();
      fence_registers<D / 2>(&acc[0][0]);
    }
  } else {
    for (int stage = r.stage_lo; stage < r.stage_hi; ++stage) {
      const int buf = (stage - r.stage_lo) % STAGES;
      const KeyLookup ahead = lookup_key<KEYS, THREADS>(p, table, stage + 2, r.key_hi);
      wait_stage(stage, buf, (buf + 1) % STAGES, static_cast<uint32_t>((stage - r.stage_lo) >> 1) & 1u);
      float s[KEYS / 8][4];
      issue_s(s, buf);
      wgmma_wait<0>();
      fence_registers<KEYS / 2>(&s[0][0]);  // S is read only after the wait
      softmax_stage<KEYS / 8, D / 8>(p, r, stage * KEYS, t, s, acc, m, l);
      // All of P is packed first: registers written between the wgmmas of a group would make ptxas
      // serialize.
      uint32_t pf[KEYS / 16][4];
#pragma unroll
      for (int kc = 0; kc < KEYS / 16; ++kc) p_fragment<T>(s[2 * kc], s[2 * kc + 1], pf[kc]);
      issue_pv(pf, buf);
      wgmma_wait<0>();
      fence_registers<D / 2>(&acc[0][0]);
      store(ahead, stage + 2);  // stage's own entries are read: reuse them
      __syncthreads();          // the buffer is refilled next; the entries are published
    }
  }
  quad_sum(l);
  store_rows<T, D>(p, r, t, acc, m, l);
}

// A sequence runs as decode tiles when all its rows fit one 16-row tile.
__host__ __device__ __forceinline__ bool decode_kind(const MmaParams& p, int seq) {
  return (p.cu[seq + 1] - p.cu[seq]) * p.group <= 16;
}

// What block x of a KV head's range does: the prefill tile `tile` of sequence `seq`, the decode
// tile of `seq` (tile -1), the padding rows (seq num_seqs) or nothing (seq -1). Blocks [0,
// prefill_blocks) are prefill tiles of R = 2^tile_shift rows, sequence b owning [first, last] =
// [cu[b] * group / R + b, cu[b + 1] * group / R + b] (the ones past its rows and a decode's
// return); then one decode block per sequence; then the padding block.
struct BlockWork {
  int seq, tile;
};
__host__ __device__ __forceinline__ BlockWork block_work(const MmaParams& p, unsigned x) {
  const int bid = static_cast<int>(x >> p.head_shift);  // x without the KV head's bits
  if (bid < p.prefill_blocks) {
    int lo = 0, hi = p.num_seqs - 1;  // the last b with first(b) <= bid (strictly increasing in b)
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if ((static_cast<int64_t>(p.cu[mid]) * p.group >> p.tile_shift) + mid <= bid) lo = mid; else hi = mid - 1;
    }
    const int last = static_cast<int>(static_cast<int64_t>(p.cu[lo + 1]) * p.group >> p.tile_shift) + lo;
    // (bid > last: past the last sequence, in the padding tokens' share of the range)
    if (bid > last || decode_kind(p, lo)) return {-1, 0};
    const int first = static_cast<int>(static_cast<int64_t>(p.cu[lo]) * p.group >> p.tile_shift) + lo;
    return {lo, p.heavy_first ? last - bid : bid - first};
  }
  const int seq = bid - p.prefill_blocks;
  if (seq < p.num_seqs) return {decode_kind(p, seq) ? seq : -1, -1};
  return {p.num_seqs, 0};
}

// WG: prefill tiles on wgmma (sm_90a, D <= 128) instead of mma.sync, TMA: their K/V by TMA where
// pages allow, PIPE: pipelined (wgmma_tile); decode tiles are the same. p is a __grid_constant__ so
// its tensor maps have an address TMA can read. The wgmma kernels keep to 168 registers at D 128
// (three blocks an SM), 128 at D 64 (four); pipelined, 255 (two) and 168 (three). WGS 2 (wgmma-2wg):
// blocks of two warpgroups, 128-row prefill tiles, decode tiles of 8 warps over 128 keys a stage;
// one block an SM.
template <typename T, int D, bool WG, bool TMA, bool PIPE = false, int WGS = 1>
__global__ void __launch_bounds__(kThreads * WGS, WGS > 1 ? 1 : WG ? (PIPE ? (D > 64 ? 2 : 3) : (D > 64 ? 3 : 4)) : 0)
    attention_mma_kernel(const __grid_constant__ MmaParams p) {
  static_assert(WGS == 1 || (WG && TMA && PIPE), "two warpgroups: the pipelined TMA tile only");
  ME_DYNAMIC_SMEM(smem);
  using S = MmaShape<D>;
  constexpr size_t offsets_at = mma_offsets_at<T, D, WG, PIPE, WGS>();
  int64_t* offsets = reinterpret_cast<int64_t*>(smem + offsets_at);
  const BlockWork w = block_work(p, blockIdx.x);
  if (w.seq < 0) return;
  if (w.seq < p.num_seqs) {
    if (w.tile < 0) {
      mma_tile<T, D, 1, 4 * WGS, S::kDecodeKeys * WGS, S::kDecodeStages>(p, smem, offsets, w.seq, 0);
    } else if constexpr (WG) {
      wgmma_tile<T, D, TMA, PIPE, WGS>(p, smem, offsets, w.seq, w.tile);
    } else {
      mma_tile<T, D, 4, 1, S::kPrefillKeys, S::kPrefillStages>(p, smem, offsets, w.seq, w.tile);
    }
    return;
  }
  // Padding rows past cu[num_seqs] are zeros: the last block of each (KV head, split) writes its KV
  // head's query heads of every num_splits-th padding token, so the work spreads over the grid.
  T* out = static_cast<T*>(p.out);
  const int64_t first = p.cu[p.num_seqs] + blockIdx.z, per_token = static_cast<int64_t>(p.group) * p.head_dim;
  const int64_t tokens = first < p.num_tokens ? (p.num_tokens - first + p.num_splits - 1) / p.num_splits : 0;
  for (int64_t i = threadIdx.x; i < tokens * per_token; i += kThreads * WGS) {
    const int64_t token = first + (i / per_token) * p.num_splits;
    const int64_t h = static_cast<int64_t>(block_kv_head(p)) * p.group + (i % per_token) / p.head_dim;
    out[token * p.so_t + h * p.so_h + i % p.head_dim] = from_float<T>(0.f);
  }
}

// out = sum_s w_s acc_s / sum_s w_s l_s with w_s = 2^(m_s - max m): one block per (token, head).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    merge_splits_kernel(const float* __restrict__ part_acc, const float* __restrict__ part_ml, T* __restrict__ out,
                        const int32_t* __restrict__ cu, int num_seqs, int num_tokens, int num_q_heads, int head_dim,
                        int num_splits, int64_t so_t, int64_t so_h) {
  const int token = blockIdx.x, head = blockIdx.y;
  if (token >= cu[num_seqs]) return;  // padding rows are zeroed by the attention kernel
  float mx = -INFINITY;
  for (int s = 0; s < num_splits; ++s) {
    mx = fmaxf(mx, part_ml[((static_cast<int64_t>(s) * num_tokens + token) * num_q_heads + head) * 2]);
  }
  const float base = mx == -INFINITY ? 0.f : mx;
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float sum = 0.f, value = 0.f;
    for (int s = 0; s < num_splits; ++s) {
      const int64_t row = (static_cast<int64_t>(s) * num_tokens + token) * num_q_heads + head;
      const float weight = exp2f(part_ml[row * 2] - base);
      sum += weight * part_ml[row * 2 + 1];
      value += weight * part_acc[row * head_dim + d];
    }
    out[static_cast<int64_t>(token) * so_t + static_cast<int64_t>(head) * so_h + d] =
        from_float<T>(sum > 0.f ? value / sum : 0.f);
  }
}

// ---- dispatch ----------------------------------------------------------------------------------

namespace {

// Why the tensor-core kernel cannot take these arguments, or "" when it can. cp.async moves 16-byte
// chunks of K/V rows (a misaligned one is a fatal error on the GPU); Q fragments are 4-byte loads.
std::string mma_unsupported(const PagedAttentionArgs& a) {
  if (a.dtype == kFloat32) return "the tensor-core kernel takes fp16 or bf16, not fp32";
  if (a.head_dim % 16 != 0) return "the tensor-core kernel needs head_dim % 16 == 0";
  const bool kv_aligned = a.k_cache % 16 == 0 && a.v_cache % 16 == 0 && a.sk_p % 8 == 0 && a.sk_s % 8 == 0 &&
                          a.sk_h % 8 == 0 && a.sv_p % 8 == 0 && a.sv_s % 8 == 0 && a.sv_h % 8 == 0;
  if (!kv_aligned) return "the tensor-core kernel needs 16-byte aligned K/V rows (pointers and strides)";
  if (a.q % 4 != 0 || a.sq_t % 2 != 0 || a.sq_h % 2 != 0) return "the tensor-core kernel needs 4-byte aligned q";
  return "";
}

// Why the wgmma kernel cannot run these arguments here, or "" when it can: the tensor-core kernel's
// rules, head dims up to 128, an sm_90 device and a build with sm_90a code (MINENGINE_SM90A).
std::string wgmma_unsupported(const PagedAttentionArgs& a) {
  std::string why = mma_unsupported(a);
  if (!why.empty()) return why;
  if (a.head_dim > 128) return "the wgmma kernel takes head_dim up to 128, not " + std::to_string(a.head_dim);
#if defined(MINENGINE_EMULATE)
  return "";
#elif !defined(MINENGINE_SM90A)
  return "the wgmma kernel needs a build with 9.0a in MINENGINE_CUDA_ARCHS";
#else
  int device = 0, major = 0, minor = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    return "the wgmma kernel could not read the device's compute capability";
  }
  if (major != 9 || minor != 0) {
    return "the wgmma kernel needs an sm_90 GPU (H100, H200); this one is sm_" + std::to_string(major * 10 + minor);
  }
  return "";
#endif
}

// The impls whose prefill tiles load K/V by TMA where tma_applies (else they run kAttentionWgmma).
__host__ __device__ constexpr bool uses_tma(int impl) {
  return impl == kAttentionWgmmaTma || impl == kAttentionWgmmaPipe || impl == kAttentionWgmma2wg;
}

// Whether the wgmma tiles can load these caches by TMA (the wgmma kernel's rules hold): pages that
// split into whole chunks of a stage's 64 keys, at least 8 slots (1024-byte aligned swizzle atoms);
// cache bases and strides 128-byte aligned (the CUDA guide's alignment for 128B-swizzled maps; the
// driver itself asks 16), strides and sizes within what a tensor map holds; CUDA 12 or later.
bool tma_applies(const PagedAttentionArgs& a) {
#if !defined(MINENGINE_EMULATE) && CUDART_VERSION < 12000
  return false;
#endif
  const bool chunks = a.page_size % 64 == 0 || (a.page_size >= 8 && 64 % a.page_size == 0);
  const int64_t strides[] = {a.sk_p, a.sk_s, a.sk_h, a.sv_p, a.sv_s, a.sv_h};
  const bool fit = std::all_of(std::begin(strides), std::end(strides), [](int64_t s) {
    return s % 64 == 0 && s < (int64_t{1} << 39);  // 2-byte elements: 128-byte steps below 2^40 bytes
  });
  return chunks && fit && a.k_cache % 128 == 0 && a.v_cache % 128 == 0 && a.num_pages >= 1 &&
         a.num_pages <= (int64_t{1} << 31);
}

#if !defined(MINENGINE_EMULATE) && CUDART_VERSION >= 12000
// The driver's tensor-map encoder, through the runtime (no link against libcuda).
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found{};
#if CUDART_VERSION >= 12050
  const cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault,
                                                           &found);
#else
  const cudaError_t err = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &fn, cudaEnableDefault, &found);
#endif
  if (err != cudaSuccess || found != cudaDriverEntryPointSuccess || fn == nullptr) {
    throw std::runtime_error("the CUDA driver has no cuTensorMapEncodeTiled (the wgmma-tma kernel needs CUDA 12)");
  }
  return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
}
#endif

// A K or V cache as the 4-D TMA map the wgmma-tma tiles load from: dims (head_dim, page_size,
// num_kv_heads, num_pages) innermost first, strides in bytes; boxes of 64 dims x `rows` slots of
// one head and page, 128B-swizzled (the wgmma B-operand layout); dims past head_dim read as zeros.
void encode_kv_map(TensorMap* map, uintptr_t base, int dtype, const PagedAttentionArgs& a, int64_t s_page,
                   int64_t s_slot, int64_t s_head, int rows) {
  const uint64_t dims[4] = {static_cast<uint64_t>(a.head_dim), static_cast<uint64_t>(a.page_size),
                            static_cast<uint64_t>(a.num_kv_heads), static_cast<uint64_t>(a.num_pages)};
  const uint64_t strides[3] = {static_cast<uint64_t>(s_slot) * 2, static_cast<uint64_t>(s_head) * 2,
                               static_cast<uint64_t>(s_page) * 2};
  const uint32_t box[4] = {64, static_cast<uint32_t>(rows), 1, 1};
#ifdef MINENGINE_EMULATE
  // The driver's rules (cuTensorMapEncodeTiled), so a map it would refuse fails here too.
  if (base % 16 != 0 || rows < 1 || rows > 256) {
    throw std::runtime_error("a tensor map the driver would refuse (base alignment or box)");
  }
  for (uint64_t s : strides) {
    if (s % 16 != 0 || s >= (uint64_t{1} << 40)) {
      throw std::runtime_error("a tensor map stride the driver would refuse");
    }
  }
  (void)dtype;
  *map = TensorMap{};
  map->base = reinterpret_cast<const char*>(base);
  for (int d = 0; d < 4; ++d) map->dims[d] = dims[d], map->box[d] = box[d];
  for (int d = 1; d < 4; ++d) map->strides[d] = strides[d - 1];
  map->encoded = true;
#elif CUDART_VERSION < 12000
  (void)map, (void)base, (void)dtype, (void)dims, (void)strides, (void)box;
  throw std::runtime_error("TMA needs CUDA 12");
#else
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  const CUtensorMapDataType type =
      dtype == kFloat16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  const CUresult rc = encode(map, type, 4, reinterpret_cast<void*>(base), dims, strides, box, element_strides,
                             CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                             CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (rc != CUDA_SUCCESS) {
    throw std::runtime_error("cuTensorMapEncodeTiled refused a K/V cache map (CUresult " + std::to_string(rc) + ")");
  }
#endif
}

}  // namespace

// The kernel paged_attention runs: auto's pick, or the one asked for if it can take the arguments
// (else std::invalid_argument saying why, as paged_attention would). wgmma-tma or wgmma-pipe asked
// for on caches TMA cannot load (tma_applies) runs the wgmma kernel as it is, with cp.async.
int attention_impl(const PagedAttentionArgs& a) {
  if (a.block_order != kBlockOrderHeavyFirst && a.block_order != kBlockOrderInOrder) {
    throw std::invalid_argument("block_order " + std::to_string(a.block_order) +
                                "; allowed: 0 (heavy-first), 1 (in-order)");
  }
  if (a.impl == kAttentionAuto) return mma_unsupported(a).empty() ? kAttentionMma : kAttentionSimt;
  if (a.impl == kAttentionMma || a.impl == kAttentionWgmma || uses_tma(a.impl)) {
    const std::string why = a.impl == kAttentionMma ? mma_unsupported(a) : wgmma_unsupported(a);
    if (!why.empty()) throw std::invalid_argument(why);
    if (uses_tma(a.impl) && !tma_applies(a)) return kAttentionWgmma;
    return a.impl;
  }
  if (a.impl == kAttentionSimt) return a.impl;
  throw std::invalid_argument("attention impl " + std::to_string(a.impl) +
                              "; allowed: 0 (auto), 1 (simt), 2 (mma), 3 (wgmma), 4 (wgmma-tma), 5 (wgmma-pipe), "
                              "6 (wgmma-2wg)");
}

namespace {

// p.prefill_blocks and the block order, from num_seqs, num_tokens, group, max_seqlen_q, block_order
// and the kernel (attention_impl's): the two-warpgroup one has 128-row prefill tiles.
void set_block_order(MmaParams& p, const PagedAttentionArgs& a, int impl) {
  p.tile_shift = impl == kAttentionWgmma2wg ? 7 : 6;
  // Prefill tiles only when some sequence may have more than 16 rows (max_seqlen_q is a host bound).
  p.prefill_blocks = a.num_seqs > 0 && a.max_seqlen_q * p.group > 16
                         ? static_cast<int>((a.num_tokens * p.group >> p.tile_shift) + a.num_seqs)
                         : 0;
  // Heavy first: 4 KV heads interleaved where 4 divide num_kv_heads, else 2 where 2 do, else 1.
  p.heavy_first = a.block_order == kBlockOrderHeavyFirst;
  p.head_shift = p.heavy_first ? (a.num_kv_heads % 4 == 0 ? 2 : a.num_kv_heads % 2 == 0 ? 1 : 0) : 0;
}

// The tensor-core kernel's grid: x a KV head group's blocks (block_work), y the head groups, z splits.
dim3 mma_grid(const PagedAttentionArgs& a, const MmaParams& p) {
  return dim3(static_cast<unsigned>((p.prefill_blocks + a.num_seqs + 1) << p.head_shift),
              static_cast<unsigned>(a.num_kv_heads >> p.head_shift), static_cast<unsigned>(a.num_splits));
}

void launch_simt(const PagedAttentionArgs& a, const FastDiv& page, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(a.num_tokens), static_cast<unsigned>(a.num_q_heads));
  const int group = static_cast<int>(a.num_q_heads / a.num_kv_heads);
  dispatch_float(a.dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    auto kernel = attention_simt_kernel<T>;
    ME_LAUNCH(kernel, grid, dim3(kThreads), kSimtSmem, stream, reinterpret_cast<const T*>(a.q),
              reinterpret_cast<const T*>(a.k_cache), reinterpret_cast<const T*>(a.v_cache), reinterpret_cast<T*>(a.out),
              reinterpret_cast<const int32_t*>(a.block_tables), reinterpret_cast<const int32_t*>(a.seq_lens),
              reinterpret_cast<const int32_t*>(a.cu_seqlens_q), static_cast<int>(a.num_seqs), group,
              static_cast<int>(a.head_dim), page, a.sq_t, a.sq_h, a.sk_p, a.sk_s, a.sk_h,
              a.sv_p, a.sv_s, a.sv_h, a.so_t, a.so_h, a.sbt, static_cast<float>(a.softmax_scale));
  });
  check_launch("paged_attention (CUDA cores)");
}

template <typename T, int D, bool WG, bool TMA = false, bool PIPE = false, int WGS = 1>
void launch_mma_dim(const PagedAttentionArgs& a, const MmaParams& p, cudaStream_t stream) {
  auto kernel = attention_mma_kernel<T, D, WG, TMA, PIPE, WGS>;
  if (p.tile_shift != (WGS == 2 ? 7 : 6)) {  // block_work's prefill tiles must be the kernel's (set_block_order)
    throw std::logic_error("prefill tiles of 2^" + std::to_string(p.tile_shift) + " rows for a kernel of " +
                           std::to_string(WGS) + " warpgroups");
  }
  constexpr size_t smem = mma_smem_bytes<T, D, WG, TMA, PIPE, WGS>();
  set_max_dynamic_smem(reinterpret_cast<const void*>(kernel), static_cast<int>(smem));
  ME_LAUNCH(kernel, mma_grid(a, p), dim3(kThreads * WGS), smem, stream, p);
  check_launch("paged_attention (tensor cores)");
  if (a.num_splits > 1) {
    auto merge = merge_splits_kernel<T>;
    const dim3 merge_grid(static_cast<unsigned>(a.num_tokens), static_cast<unsigned>(a.num_q_heads));
    ME_LAUNCH(merge, merge_grid, dim3(kThreads), 0, stream, p.part_acc, p.part_ml, static_cast<T*>(p.out), p.cu,
              p.num_seqs, p.num_tokens, p.num_q_heads, p.head_dim, p.num_splits, p.so_t, p.so_h);
    check_launch("paged_attention (merge splits)");
  }
}

template <typename T>
void launch_mma(const PagedAttentionArgs& a, const MmaParams& p, int impl, cudaStream_t stream) {
  if (impl == kAttentionWgmma2wg) {  // head_dim <= 128 (wgmma_unsupported)
    if (a.head_dim <= 64) launch_mma_dim<T, 64, true, true, true, 2>(a, p, stream);
    else launch_mma_dim<T, 128, true, true, true, 2>(a, p, stream);
  } else if (impl == kAttentionWgmmaPipe) {  // head_dim <= 128 (wgmma_unsupported)
    if (a.head_dim <= 64) launch_mma_dim<T, 64, true, true, true>(a, p, stream);
    else launch_mma_dim<T, 128, true, true, true>(a, p, stream);
  } else if (impl == kAttentionWgmmaTma) {
    if (a.head_dim <= 64) launch_mma_dim<T, 64, true, true>(a, p, stream);
    else launch_mma_dim<T, 128, true, true>(a, p, stream);
  } else if (impl == kAttentionWgmma) {
    if (a.head_dim <= 64) launch_mma_dim<T, 64, true>(a, p, stream);
    else launch_mma_dim<T, 128, true>(a, p, stream);
  } else if (a.head_dim <= 64) {
    launch_mma_dim<T, 64, false>(a, p, stream);
  } else if (a.head_dim <= 128) {
    launch_mma_dim<T, 128, false>(a, p, stream);
  } else {
    launch_mma_dim<T, 256, false>(a, p, stream);
  }
}

}  // namespace

void paged_attention(const PagedAttentionArgs& a) {
  if (a.num_tokens == 0) return;
  if (a.head_dim > kMaxHeadDim) throw std::invalid_argument("head_dim " + std::to_string(a.head_dim) + " above 256");
  if (a.num_q_heads > 65535) {  // grid y of the CUDA-core and merge kernels
    throw std::invalid_argument("num_q_heads " + std::to_string(a.num_q_heads) + "; allowed: 1 to 65535");
  }
  if (a.num_splits < 1 || a.num_splits > 65535) {
    throw std::invalid_argument("num_splits " + std::to_string(a.num_splits) + "; allowed: 1 to 65535");
  }
  const FastDiv page(a.page_size, "page_size");
  auto stream = reinterpret_cast<cudaStream_t>(a.stream);
  const int impl = attention_impl(a);
  if (impl == kAttentionSimt) {  // no split path: num_splits is ignored
    launch_simt(a, page, stream);
    return;
  }
  if (a.num_splits > 1 && (a.part_acc == 0 || a.part_ml == 0)) {
    throw std::invalid_argument("num_splits > 1 needs the part_acc and part_ml workspaces");
  }
  MmaParams p{};
  p.q = reinterpret_cast<const void*>(a.q);
  p.k_cache = reinterpret_cast<const void*>(a.k_cache);
  p.v_cache = reinterpret_cast<const void*>(a.v_cache);
  p.out = reinterpret_cast<void*>(a.out);
  p.part_acc = reinterpret_cast<float*>(a.part_acc);
  p.part_ml = reinterpret_cast<float*>(a.part_ml);
  p.block_tables = reinterpret_cast<const int32_t*>(a.block_tables);
  p.seq_lens = reinterpret_cast<const int32_t*>(a.seq_lens);
  p.cu = reinterpret_cast<const int32_t*>(a.cu_seqlens_q);
  p.num_seqs = static_cast<int>(a.num_seqs);
  p.num_tokens = static_cast<int>(a.num_tokens);
  p.num_q_heads = static_cast<int>(a.num_q_heads);
  p.group = static_cast<int>(a.num_q_heads / a.num_kv_heads);
  p.head_dim = static_cast<int>(a.head_dim);
  p.page = page;
  p.num_splits = static_cast<int>(a.num_splits);
  set_block_order(p, a, impl);
  p.sq_t = a.sq_t, p.sq_h = a.sq_h, p.sk_p = a.sk_p, p.sk_s = a.sk_s, p.sk_h = a.sk_h;
  p.sv_p = a.sv_p, p.sv_s = a.sv_s, p.sv_h = a.sv_h, p.so_t = a.so_t, p.so_h = a.so_h, p.sbt = a.sbt;
  p.scale_log2 = static_cast<float>(std::fabs(a.softmax_scale)) * kLog2e;
  p.q_sign = a.softmax_scale < 0 ? 0x80008000u : 0u;
  if (uses_tma(impl)) {  // (attention_impl checked that TMA applies)
    p.tma_rows = static_cast<int>(a.page_size < 64 ? a.page_size : 64);
    while ((1 << p.tma_shift) < p.tma_rows) ++p.tma_shift;
    encode_kv_map(&p.k_map, a.k_cache, a.dtype, a, a.sk_p, a.sk_s, a.sk_h, p.tma_rows);
    encode_kv_map(&p.v_map, a.v_cache, a.dtype, a, a.sv_p, a.sv_s, a.sv_h, p.tma_rows);
  }
  if (a.dtype == kFloat16) launch_mma<__half>(a, p, impl, stream);
  else launch_mma<__nv_bfloat16>(a, p, impl, stream);
}

#ifdef MINENGINE_EMULATE
std::vector<int32_t> attention_block_order(const PagedAttentionArgs& a) {
  const int impl = attention_impl(a);
  if (impl == kAttentionSimt) throw std::invalid_argument("the CUDA-core kernel has no block order");
  MmaParams p{};
  p.cu = reinterpret_cast<const int32_t*>(a.cu_seqlens_q);
  p.num_seqs = static_cast<int>(a.num_seqs);
  p.group = static_cast<int>(a.num_q_heads / a.num_kv_heads);
  set_block_order(p, a, impl);
  const dim3 grid = mma_grid(a, p);
  std::vector<int32_t> order;
  for (unsigned y = 0; y < grid.y; ++y) {
    for (unsigned x = 0; x < grid.x; ++x) {
      const BlockWork w = block_work(p, x);
      order.insert(order.end(), {kv_head_of(p, x, y), w.seq, w.tile});
    }
  }
  return order;
}
#endif

}  // namespace minengine
