// Launchers of the minengine CUDA kernels. Arguments are raw device pointers, sizes, strides (in
// elements), dtype codes and the CUDA stream, all as plain integers: no torch C++ ABI involved.
#pragma once

#include <cstdint>

namespace minengine {

struct PagedAttentionArgs {
  uintptr_t q, k_cache, v_cache, out, block_tables, seq_lens, cu_seqlens_q;
  int64_t num_tokens, num_seqs, num_q_heads, num_kv_heads, head_dim, page_size;
  int64_t sq_t, sq_h, sk_p, sk_s, sk_h, sv_p, sv_s, sv_h, so_t, so_h, sbt;
  double softmax_scale;
  int dtype;
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
void store_kv(const StoreKVArgs& args);
void gather_input_ids(const GatherArgs& args);

}  // namespace minengine
