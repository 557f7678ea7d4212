// pybind11 bindings of minengine._C: every argument is a Python int or float (pointers from
// tensor.data_ptr(), the stream from torch.cuda.current_stream().cuda_stream), so the module does
// not depend on the torch C++ ABI and one build serves every torch version.
#include <pybind11/pybind11.h>

#include "kernels.h"

namespace py = pybind11;
using namespace minengine;

PYBIND11_MODULE(_C, m) {
  m.doc() = "minengine CUDA kernels (raw pointers, no torch ABI)";

  m.def(
      "paged_attention",
      [](uintptr_t q, uintptr_t k_cache, uintptr_t v_cache, uintptr_t out, uintptr_t block_tables, uintptr_t seq_lens,
         uintptr_t cu_seqlens_q, int64_t num_tokens, int64_t num_seqs, int64_t num_q_heads, int64_t num_kv_heads,
         int64_t head_dim, int64_t page_size, int64_t sq_t, int64_t sq_h, int64_t sk_p, int64_t sk_s, int64_t sk_h,
         int64_t sv_p, int64_t sv_s, int64_t sv_h, int64_t so_t, int64_t so_h, int64_t sbt, double softmax_scale,
         int dtype, uintptr_t stream) {
        paged_attention({q, k_cache, v_cache, out, block_tables, seq_lens, cu_seqlens_q, num_tokens, num_seqs,
                         num_q_heads, num_kv_heads, head_dim, page_size, sq_t, sq_h, sk_p, sk_s, sk_h, sv_p, sv_s,
                         sv_h, so_t, so_h, sbt, softmax_scale, dtype, stream});
      },
      py::kw_only(), py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("out"), py::arg("block_tables"),
      py::arg("seq_lens"), py::arg("cu_seqlens_q"), py::arg("num_tokens"), py::arg("num_seqs"),
      py::arg("num_q_heads"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("page_size"), py::arg("sq_t"),
      py::arg("sq_h"), py::arg("sk_p"), py::arg("sk_s"), py::arg("sk_h"), py::arg("sv_p"), py::arg("sv_s"),
      py::arg("sv_h"), py::arg("so_t"), py::arg("so_h"), py::arg("sbt"), py::arg("softmax_scale"), py::arg("dtype"),
      py::arg("stream"));

  m.def(
      "store_kv",
      [](uintptr_t k, uintptr_t v, uintptr_t k_cache, uintptr_t v_cache, uintptr_t slot_mapping, int64_t num_tokens,
         int64_t num_heads, int64_t head_dim, int64_t page_size, int64_t sk_t, int64_t sk_h, int64_t sv_t,
         int64_t sv_h, int64_t skc_p, int64_t skc_s, int64_t skc_h, int64_t svc_p, int64_t svc_s, int64_t svc_h,
         int dtype, uintptr_t stream) {
        store_kv({k, v, k_cache, v_cache, slot_mapping, num_tokens, num_heads, head_dim, page_size, sk_t, sk_h, sv_t,
                  sv_h, skc_p, skc_s, skc_h, svc_p, svc_s, svc_h, dtype, stream});
      },
      py::kw_only(), py::arg("k"), py::arg("v"), py::arg("k_cache"), py::arg("v_cache"), py::arg("slot_mapping"),
      py::arg("num_tokens"), py::arg("num_heads"), py::arg("head_dim"), py::arg("page_size"), py::arg("sk_t"),
      py::arg("sk_h"), py::arg("sv_t"), py::arg("sv_h"), py::arg("skc_p"), py::arg("skc_s"), py::arg("skc_h"),
      py::arg("svc_p"), py::arg("svc_s"), py::arg("svc_h"), py::arg("dtype"), py::arg("stream"));

  m.def(
      "gather_input_ids",
      [](uintptr_t prefill_ids, uintptr_t token_buffer, uintptr_t decode_indices, uintptr_t out, int64_t num_prefill,
         int64_t num_decode, int64_t sp, int64_t sb, int64_t si, int64_t so, int id_dtype, int index_dtype,
         uintptr_t stream) {
        gather_input_ids({prefill_ids, token_buffer, decode_indices, out, num_prefill, num_decode, sp, sb, si, so,
                          id_dtype, index_dtype, stream});
      },
      py::kw_only(), py::arg("prefill_ids"), py::arg("token_buffer"), py::arg("decode_indices"), py::arg("out"),
      py::arg("num_prefill"), py::arg("num_decode"), py::arg("sp"), py::arg("sb"), py::arg("si"), py::arg("so"),
      py::arg("id_dtype"), py::arg("index_dtype"), py::arg("stream"));
}
