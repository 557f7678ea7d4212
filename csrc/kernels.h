// Launchers of the minengine CUDA kernels. Arguments are raw device pointers, sizes, strides (in
// elements), dtype codes and the CUDA stream, all as plain integers: no torch C++ ABI involved.
#pragma once

#include <cstdint>
#ifdef MINENGINE_EMULATE
#include <vector>
#endif

namespace minengine {

// impl: kAttentionAuto picks the tensor-core kernel when it applies (fp16/bf16 and 16-byte aligned
// K/V rows, 4-byte aligned q rows), else the CUDA-core one. kAttentionWgmma, never picked by auto,
// runs the tensor-core kernel with Hopper wgmma prefill tiles (an sm_90 GPU, a 9.0a build,
// head_dim <= 128); kAttentionWgmmaTma the same tiles with their K/V stages loaded by TMA where
// whole chunks of pages allow (page_size 8, 16, 32, 64 or a multiple of 64, 128-byte aligned cache
// bases and strides; elsewhere it runs kAttentionWgmma); kAttentionWgmmaPipe those TMA tiles
// pipelined (a stage's softmax under the previous stage's P V; the same fallback);
// kAttentionWgmma2wg those pipelined TMA tiles with two warpgroups a block, 128 rows a prefill tile
// sharing each K/V stage (the same fallback). num_splits > 1
// (the tensor-core kernel; the CUDA-core one ignores it) needs part_acc, fp32 [num_splits,
// num_tokens, Hq, head_dim], and part_ml, fp32 [.., Hq, 2].
enum AttentionImpl : int {
  kAttentionAuto = 0,
  kAttentionSimt = 1,
  kAttentionMma = 2,
  kAttentionWgmma = 3,
  kAttentionWgmmaTma = 4,
  kAttentionWgmmaPipe = 5,
  kAttentionWgmma2wg = 6
};

// block_order: kBlockOrderHeavyFirst starts each sequence's prefill tiles last (most keys) first,
// with up to 4 KV heads' blocks interleaved; kBlockOrderInOrder, the order before it (first tile
// first, one KV head after another), for benchmarks. Either order gives the same output.
enum BlockOrder : int { kBlockOrderHeavyFirst = 0, kBlockOrderInOrder = 1 };

struct PagedAttentionArgs {
  uintptr_t q, k_cache, v_cache, out, block_tables, seq_lens, cu_seqlens_q, part_acc, part_ml;
  int64_t num_tokens, num_seqs, num_q_heads, num_kv_heads, head_dim, page_size, num_pages, max_seqlen_q, num_splits;
  int64_t sq_t, sq_h, sk_p, sk_s, sk_h, sv_p, sv_s, sv_h, so_t, so_h, sbt;
  double softmax_scale;
  int dtype, impl, block_order;
  uintptr_t stream;
};

struct StoreKVArgs {
  uintptr_t k, v, k_cache, v_cache, slot_mapping;
  int64_t num_tokens, num_heads, head_dim, page_size;
  int64_t sk_t, sk_h, sv_t, sv_h, skc_p, skc_s, skc_h, svc_p, svc_s, svc_h;
  int dtype;
  uintptr_t stream;
};

struct GatherArgs {
  uintptr_t prefill_ids, token_buffer, decode_indices, out;
  int64_t num_prefill, num_decode, sp, sb, si, so;
  int id_dtype, index_dtype;
  uintptr_t stream;
};

void paged_attention(const PagedAttentionArgs& args);
// Which kernel paged_attention runs for these arguments (kAttentionSimt, kAttentionMma, kAttentionWgmma,
// kAttentionWgmmaTma, kAttentionWgmmaPipe or kAttentionWgmma2wg);
// std::invalid_argument, as from paged_attention, where the kernel asked for cannot take them.
int attention_impl(const PagedAttentionArgs& args);
#ifdef MINENGINE_EMULATE
// The tensor-core kernel's blocks of split 0 in launch order (grid x fastest), three ints each: KV
// head, sequence and tile as block_work says (tests; the emulator only, where cu_seqlens_q is host
// memory).
std::vector<int32_t> attention_block_order(const PagedAttentionArgs& args);
#endif
void store_kv(const StoreKVArgs& args);
void gather_input_ids(const GatherArgs& args);

}  // namespace minengine
