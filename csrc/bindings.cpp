// pybind11 bindings of minengine._C: every argument is a Python int or float (pointers from
// tensor.data_ptr(), the stream from torch.cuda.current_stream().cuda_stream), so the module does
// not depend on the torch C++ ABI and one build serves every torch version.
#include <pybind11/pybind11.h>

#include "kernels.h"

namespace py = pybind11;
using namespace minengine;

PYBIND11_MODULE(_C, m) {
  m.doc() = "minengine CUDA kernels (raw pointers, no torch ABI)";

  // paged_attention and attention_impl take the same keyword arguments (PagedAttentionArgs).
  auto attention_args = [](py::kwargs kw) {
    auto p = [&](const char* name) { return kw[name].cast<uintptr_t>(); };
    auto i = [&](const char* name) { return kw[name].cast<int64_t>(); };
    PagedAttentionArgs a{};
    a.q = p("q"), a.k_cache = p("k_cache"), a.v_cache = p("v_cache"), a.out = p("out");
    a.block_tables = p("block_tables"), a.seq_lens = p("seq_lens"), a.cu_seqlens_q = p("cu_seqlens_q");
    a.part_acc = p("part_acc"), a.part_ml = p("part_ml");
    a.num_tokens = i("num_tokens"), a.num_seqs = i("num_seqs"), a.num_q_heads = i("num_q_heads");
    a.num_kv_heads = i("num_kv_heads"), a.head_dim = i("head_dim"), a.page_size = i("page_size");
    a.num_pages = i("num_pages");
    a.max_seqlen_q = i("max_seqlen_q"), a.num_splits = i("num_splits");
    a.sq_t = i("sq_t"), a.sq_h = i("sq_h"), a.sk_p = i("sk_p"), a.sk_s = i("sk_s"), a.sk_h = i("sk_h");
    a.sv_p = i("sv_p"), a.sv_s = i("sv_s"), a.sv_h = i("sv_h"), a.so_t = i("so_t"), a.so_h = i("so_h");
    a.sbt = i("sbt");
    a.softmax_scale = kw["softmax_scale"].cast<double>();
    a.dtype = kw["dtype"].cast<int>(), a.impl = kw["impl"].cast<int>(), a.block_order = kw["block_order"].cast<int>();
    a.stream = p("stream");
    if (kw.size() != 34) throw py::type_error("paged_attention takes exactly the 34 PagedAttentionArgs keywords");
    return a;
  };
  m.def("paged_attention", [attention_args](py::kwargs kw) { paged_attention(attention_args(kw)); });
  m.def("attention_impl", [attention_args](py::kwargs kw) { return attention_impl(attention_args(kw)); },
        "which kernel would run for these arguments: 1 the CUDA-core one, 2 the tensor-core one, 3 the "
        "tensor-core one with wgmma prefill tiles, 4 those tiles with TMA loads, 5 the TMA tiles "
        "pipelined");

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
