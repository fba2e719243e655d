// LlamaForward's decoder layers for one pass, in C++ (specops/core/native.py): the Python loop's products and cache
// writes (specops/core/llama.py, LlamaForward._layers_python) on the same tensors in the same order, so the same
// bits; attention through native_attention.cpp's kernel, which reads each sequence's cache in place (the Python
// loop pads and stacks them for ATen's matmuls, and rounds otherwise). For bf16 passes the norms, rotary, SiLU
// and residual adds run as row kernels (native_elementwise.cpp: rotary and the adds ATen's bits, the norms'
// sums and SiLU's exp their own); fp32 passes keep ATen's ops for them. Who dispatches: ~45 ops a layer from
// Python cost a few microseconds each and took the GIL back after each one, which a batched server's generation
// threads (verifying, streaming, drafting in Python) hold much of the time; here a pass holds no GIL from its
// first layer to its last, and a bf16 layer is ~12 calls, not ~45 ATen ops.
//
// The plan of a pass (which rows are whose, what each row sees) is built in Python once per pass
// (llama._AttentionPlan) and handed over as the plain structs below.

#include <ATen/ScalarOps.h>
#include <torch/extension.h>

#include "native_attention.h"
#include "native_elementwise.h"
#include "native_linear.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

namespace {

using at::Tensor;
using at::indexing::Slice;
using OptionalTensor = std::optional<Tensor>;

// One sequence's rows in the pass: rows start..start+size at cache slots `pos`, row r seeing slots 0..ends[r]-1;
// a tree's rows are written to branch caches instead (keys[layer][branch, :, slot] = row, as llama.Branches
// says) and row r attends in branch owner[r].
struct Sequence {
  std::vector<Tensor> keys, values;  // per layer: [kv_heads, length, D], or a tree's [branches, kv_heads, length, D]
  Tensor pos;
  int64_t start, size;
  OptionalTensor branch, slot, row;  // a tree's writes: pass row row[i] goes to branch[i] at slot[i]
  Tensor ends;
  OptionalTensor owner;
};

struct Plan {
  std::vector<Sequence> sequences;
};

// A Python number as Python passes it to an op: a double "wrapped number" tensor, which a bf16 op reads in its
// float opmath. (`Tensor::mul_(Scalar)` from C++ rounds the number to the tensor's dtype first: 0.1767... as a
// bf16 scale rounded ATen attention's scores differently from Python's `mul_(d ** -0.5)`.)
Tensor number(double value) {
  Tensor out = at::scalar_to_tensor(value);
  out.unsafeGetTensorImpl()->set_wrapped_number(true);
  return out;
}

// mkldnn::_linear_pointwise on a weight packed by specops.core.packed_linear.pack, as _packed_product calls it.
Tensor packed_product(const Tensor& x, const Tensor& packed) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                       .typed<Tensor(const Tensor&, const Tensor&, const OptionalTensor&, c10::string_view,
                                     c10::List<std::optional<at::Scalar>>, std::optional<c10::string_view>)>();
  return op.call(x, packed, std::nullopt, "none", c10::List<std::optional<at::Scalar>>(), c10::string_view(""));
}

// x @ weight.T as specops.core.packed_linear.linear computes it: on the packed weight, ours
// (native_linear.cpp) or oneDNN's (an opaque mkldnn tensor), or F.linear's where there is none.
Tensor product(const Tensor& x, const Tensor& weight, const OptionalTensor& packed) {
  if (!packed) return at::linear(x, weight);
  return packed->is_mkldnn() ? packed_product(x, *packed) : specops::linear_packed(x, *packed);
}

// llama.rms_norm: the statistics in float32, the scale in the model dtype.
Tensor llama_rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  Tensor h = x.to(at::kFloat);
  h = h * at::rsqrt(h.pow(2).mean(-1, true) + number(eps));
  return weight * h.to(x.scalar_type());
}

// llama.rotate.
Tensor rotate(const Tensor& x, const Tensor& cos, const Tensor& sin) {
  const int64_t half = x.size(-1) / 2;
  return x * cos + at::cat({-x.slice(-1, half), x.slice(-1, 0, half)}, -1) * sin;
}

class Decoder {
 public:
  Decoder(std::vector<Tensor> attn_norm, std::vector<Tensor> mlp_norm, std::vector<Tensor> qkv, std::vector<Tensor> o,
          std::vector<Tensor> gate_up, std::vector<Tensor> down, std::vector<OptionalTensor> qkv_packed,
          std::vector<OptionalTensor> o_packed, std::vector<OptionalTensor> gate_up_packed,
          std::vector<OptionalTensor> down_packed, double eps, int64_t heads, int64_t kv_heads, int64_t head_dim)
      : attn_norm_(std::move(attn_norm)), mlp_norm_(std::move(mlp_norm)), qkv_(std::move(qkv)), o_(std::move(o)),
        gate_up_(std::move(gate_up)), down_(std::move(down)), qkv_packed_(std::move(qkv_packed)),
        o_packed_(std::move(o_packed)), gate_up_packed_(std::move(gate_up_packed)),
        down_packed_(std::move(down_packed)), eps_(eps), heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim) {}

  // The first `layers` layers over x [n, H] (rows already embedded, padded rows included) with the rows' rotary
  // tables cos, sin [n, D]; each layer's output [n, H]. `packed`: the products on the packed weights.
  std::vector<Tensor> run(Tensor x, const Tensor& cos, const Tensor& sin, Plan& plan, int64_t layers,
                          bool packed) const {
    const at::NoGradGuard no_grad;  // whatever the caller's grad mode: a pass's outputs need no graph
    const int64_t n = x.size(0), q_size = heads_ * head_dim_;
    // bf16 passes (what a server runs) take the row kernels (native_elementwise.cpp); fp32 ones ATen's ops.
    const bool rows = x.scalar_type() == at::kBFloat16;
    const OptionalTensor none;
    std::vector<Tensor> captured;
    captured.reserve(layers);
    for (int64_t i = 0; i < layers; ++i) {
      Tensor h = norm(x, attn_norm_[i], rows);
      const auto [q, k, v] = rotated(product(h, qkv_[i], packed ? qkv_packed_[i] : none), cos, sin, rows);
      for (Sequence& s : plan.sequences) {
        if (!s.branch) {
          write(s.keys[i], s.values[i], k, v, s);
        } else {
          s.keys[i].index_put_({*s.branch, Slice(), *s.slot}, k.index_select(1, *s.row).transpose(0, 1));
          s.values[i].index_put_({*s.branch, Slice(), *s.slot}, v.index_select(1, *s.row).transpose(0, 1));
        }
      }
      Tensor att = attend(q.contiguous(), i, plan, n);
      x = add(x, product(att.transpose(0, 1).reshape({n, q_size}), o_[i], packed ? o_packed_[i] : none), rows);
      h = norm(x, mlp_norm_[i], rows);
      Tensor gate_up = product(h, gate_up_[i], packed ? gate_up_packed_[i] : none);
      x = add(x, product(gated(gate_up, rows), down_[i], packed ? down_packed_[i] : none), rows);
      captured.push_back(x);
    }
    return captured;
  }

 private:
  Tensor norm(const Tensor& x, const Tensor& weight, bool rows) const {
    return rows ? specops::rms_norm_rows(x, weight, eps_) : llama_rms_norm(x, weight, eps_);
  }

  // q [heads, n, D] and k [kv_heads, n, D] rotated, v [kv_heads, n, D], from a pass's qkv product [n, ...].
  std::tuple<Tensor, Tensor, Tensor> rotated(const Tensor& qkv, const Tensor& cos, const Tensor& sin,
                                             bool rows) const {
    if (rows) return specops::rotate_rows(qkv, cos, sin, heads_, kv_heads_);
    const int64_t n = qkv.size(0), split = (heads_ + kv_heads_) * head_dim_;
    Tensor qk = rotate(qkv.slice(1, 0, split).view({n, heads_ + kv_heads_, head_dim_}).transpose(0, 1), cos, sin);
    Tensor v = qkv.slice(1, split).view({n, kv_heads_, head_dim_}).transpose(0, 1);
    return {qk.slice(0, 0, heads_), qk.slice(0, heads_), v};
  }

  static Tensor add(const Tensor& x, const Tensor& y, bool rows) { return rows ? specops::add_rows(x, y) : x + y; }

  static Tensor gated(const Tensor& gate_up, bool rows) {
    if (rows) return specops::silu_mul_rows(gate_up);
    std::vector<Tensor> halves = gate_up.chunk(2, -1);
    return at::silu(halves[0]) * halves[1];
  }

  // keys[:, pos[r]] = k[:, start + r] and values[:, pos[r]] = v[:, start + r] for a chain's rows: index_copy_'s
  // values, as one copy per row and kv head (the slots checked once for both caches, which share their shape).
  static void write(Tensor& keys, Tensor& values, const Tensor& k, const Tensor& v, const Sequence& s) {
    const auto copyable = [](const Tensor& cache, const Tensor& rows) {
      return cache.is_contiguous() && rows.stride(2) == 1 && cache.scalar_type() == rows.scalar_type();
    };
    if (!copyable(keys, k) || !copyable(values, v) || keys.sizes() != values.sizes()) {
      keys.index_copy_(1, s.pos, k.slice(1, s.start, s.start + s.size));
      values.index_copy_(1, s.pos, v.slice(1, s.start, s.start + s.size));
      return;
    }
    const Tensor slots = s.pos.contiguous();
    const int64_t* pos = slots.data_ptr<int64_t>();
    const int64_t length = keys.size(1), size = keys.element_size(), bytes = keys.size(2) * size;
    for (int64_t r = 0; r < s.size; ++r) TORCH_CHECK(pos[r] >= 0 && pos[r] < length, "a cache write past its end");
    for (const auto& [cache, rows] : {std::pair<const Tensor&, const Tensor&>{keys, k}, {values, v}}) {
      char* to = static_cast<char*>(cache.data_ptr());
      const char* from = static_cast<const char*>(rows.data_ptr());
      for (int64_t h = 0; h < cache.size(0); ++h)
        for (int64_t r = 0; r < s.size; ++r)
          std::memcpy(to + (h * length + pos[r]) * bytes,
                      from + (h * rows.stride(0) + (s.start + r) * rows.stride(1)) * size, bytes);
    }
  }

  // Attention outputs [heads, n, D] for the queries q [heads, n, D] at `layer`: every row through the kernel, a
  // prompt's too, so that a prompt's rows do not depend on how it is cut into passes (specops.core.prefix_cache).
  Tensor attend(const Tensor& q, int64_t layer, const Plan& plan, int64_t n) const {
    Tensor att = q.new_zeros({heads_, n, head_dim_});
    std::vector<specops::AttendRows> rows;
    for (const Sequence& s : plan.sequences) rows.push_back({s.keys[layer], s.values[layer], s.start, s.size, s.ends, s.owner});
    specops::attend_rows(q, att, rows);
    return att;
  }

  std::vector<Tensor> attn_norm_, mlp_norm_, qkv_, o_, gate_up_, down_;
  std::vector<OptionalTensor> qkv_packed_, o_packed_, gate_up_packed_, down_packed_;
  double eps_;
  int64_t heads_, kv_heads_, head_dim_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Sequence>(m, "Sequence")
      .def(py::init<std::vector<Tensor>, std::vector<Tensor>, Tensor, int64_t, int64_t, OptionalTensor, OptionalTensor,
                    OptionalTensor, Tensor, OptionalTensor>());
  py::class_<Plan>(m, "Plan").def(py::init<std::vector<Sequence>>());
  // The kernel alone, for tests and benchmarks: out [heads, n, D] for q [heads, n, D], per sequence its keys and
  // values [kv_heads, length, D] (a tree's: [branches, ...] with owner), first row, row count and ends.
  m.def("attend_rows",
        [](const Tensor& q, Tensor& out, const std::vector<Tensor>& keys, const std::vector<Tensor>& values,
           const std::vector<int64_t>& starts, const std::vector<Tensor>& ends, const std::vector<OptionalTensor>& owners) {
          std::vector<specops::AttendRows> rows;
          for (size_t j = 0; j < keys.size(); ++j) rows.push_back({keys[j], values[j], starts[j], ends[j].size(0), ends[j], owners[j]});
          specops::attend_rows(q, out, rows);
        },
        py::call_guard<py::gil_scoped_release>());
  m.def("attention_path", &specops::attention_path);
  m.def("linear_supported", &specops::linear_supported);
  m.def("amx_supported", &specops::amx_supported);
  m.def("pack_linear", &specops::pack_linear, py::arg("weight"), py::arg("amx"));
  m.def("linear_packed", &specops::linear_packed, py::call_guard<py::gil_scoped_release>());
  // The decoder's bf16 row ops alone: the tests, which also run the Python loop on them where it must match.
  m.def("rms_norm_rows", &specops::rms_norm_rows, py::call_guard<py::gil_scoped_release>());
  m.def("rotate_rows", &specops::rotate_rows, py::call_guard<py::gil_scoped_release>());
  m.def("silu_mul_rows", &specops::silu_mul_rows, py::call_guard<py::gil_scoped_release>());
  m.def("add_rows", &specops::add_rows, py::call_guard<py::gil_scoped_release>());
  m.def("elementwise_vector", &specops::elementwise_vector);
  // ATen sets a thread's intra-op count from the process-wide last value any thread set, once per thread, at its
  // first parallel op, and this extension inlines its own copy of that once (at::internal::lazy_init_num_threads):
  // run it now, so that the count the thread sets next stays (specops.core.native.set_threads).
  m.def("init_threads", [] { at::internal::lazy_init_num_threads(); });
  py::class_<Decoder>(m, "Decoder")
      .def(py::init<std::vector<Tensor>, std::vector<Tensor>, std::vector<Tensor>, std::vector<Tensor>,
                    std::vector<Tensor>, std::vector<Tensor>, std::vector<OptionalTensor>, std::vector<OptionalTensor>,
                    std::vector<OptionalTensor>, std::vector<OptionalTensor>, double, int64_t, int64_t, int64_t>())
      // The pass runs without the GIL: the arguments are converted before it is released.
      .def("run", &Decoder::run, py::call_guard<py::gil_scoped_release>());
}
