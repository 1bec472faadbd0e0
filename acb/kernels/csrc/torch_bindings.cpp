// The Python face of acb's native CPU kernel library: every op of ops.h and decode_loop.h, bound once,
// in one submodule per kernel family (acb/kernels/cpu.py hands them out: fused_kernels() is `fused`,
// paged_decode_kernel() `attention`, int8_kernels() `int8`, bf16_kernels() `bf16`, lora_kernels()
// `lora`). The only file of the library that includes pybind11 (a third of a kernel file's compile
// otherwise: torch_min.h). The GIL is released while a kernel runs: the event loop's thread keeps
// serving.
#include "ops.h"
#include "decode_loop.h"
#include <torch/csrc/utils/pybind.h>

namespace {

// acb.watch.ModelWatch's check of the weights before every step, in one C++ loop: each parameter or
// buffer still the object its owner dict holds under its name, at the same address, with the same
// in-place version counter (inference tensors keep none). The Python check (three passes of map over
// the lists) took ~0.58 ms a step on SmolLM2's int8 model (~700 tensors) in the engine, on the event
// loop's thread, where the forward running beside it leaves none of those objects in cache: each
// tensor's Python object, its TensorImpl, version counter and storage read one after another. Here
// the tensors' impls are held directly and the loop's iterations are independent, so their cache
// misses overlap. Called with the GIL held (it reads the owners' dicts).
class WeightWatch {
 public:
  WeightWatch(const py::list& owners, const py::list& names, const py::list& tensors) {
    TORCH_CHECK(owners.size() == names.size() && names.size() == tensors.size(),
                "owners, names and tensors must be lists of one length");
    for (size_t i = 0; i < tensors.size(); ++i) {
      TORCH_CHECK(PyDict_Check(owners[i].ptr()), "owners must be dicts");
      owners_.push_back(py::reinterpret_borrow<py::object>(owners[i]));
      names_.push_back(py::reinterpret_borrow<py::object>(names[i]));
      objects_.push_back(py::reinterpret_borrow<py::object>(tensors[i]));
      const at::Tensor t = tensors[i].cast<at::Tensor>();
      const bool versioned = !t.is_inference();
      versioned_.push_back(versioned);
      versions_.push_back(versioned ? t._version() : 0);
      ptrs_.push_back(t.data_ptr());
      tensors_.push_back(t);
    }
  }
  // Whether any tensor was replaced in its owner, moved (a new data pointer) or edited in place
  bool changed() const {
    const size_t n = tensors_.size();
    for (size_t i = 0; i < n; ++i) {
      PyObject* now = PyDict_GetItemWithError(owners_[i].ptr(), names_[i].ptr());  // borrowed
      if (now == nullptr && PyErr_Occurred()) throw py::error_already_set();
      if (now != objects_[i].ptr()) return true;
    }
    for (size_t i = 0; i < n; ++i)
      if ((versioned_[i] && tensors_[i]._version() != versions_[i]) || tensors_[i].data_ptr() != ptrs_[i])
        return true;
    return false;
  }
  size_t size() const { return tensors_.size(); }

 private:
  std::vector<py::object> owners_, names_, objects_;
  std::vector<at::Tensor> tensors_;
  std::vector<bool> versioned_;
  std::vector<int64_t> versions_;
  std::vector<void*> ptrs_;
};

void bind_fused(py::module_ m) {
  m.def("rms_norm", &acb::fused::rms_norm, "RMSNorm over rows (float32 or bfloat16)",
        py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm_f32w", &acb::fused::rms_norm_f32w, "Gemma's RMSNorm over rows (float32 weight, one rounding)",
        py::call_guard<py::gil_scoped_release>());
  m.def("glu", &acb::fused::glu, "act(gate) * up over one GEMM's [T, 2N] output (float32 or bfloat16)",
        py::call_guard<py::gil_scoped_release>());
  m.def("rope_", &acb::fused::rope_, "rotary embedding in place (float32 or bfloat16)",
        py::call_guard<py::gil_scoped_release>());
  py::class_<WeightWatch>(m, "WeightWatch", "acb.watch's weight check (owners' dicts, names, tensors)")
      .def(py::init<const py::list&, const py::list&, const py::list&>())
      .def("changed", &WeightWatch::changed, "any tensor replaced, moved or edited in place since")
      .def("__len__", &WeightWatch::size);
  m.def("argmax_rows", &acb::fused::argmax_rows, "torch.argmax(x, dim=-1) of float32 rows, int64",
        py::call_guard<py::gil_scoped_release>());
}

void bind_attention(py::module_ m) {
  using namespace acb::attention;
  m.def("paged_decode", &paged_decode, "paged decode attention (CPU)", py::call_guard<py::gil_scoped_release>());
  m.def("paged_decode_into", &paged_decode_into,
        "a decode-only step's attention: cache writes, attention, output in the model's dtype (CPU)",
        py::arg("q"), py::arg("k_new"), py::arg("v_new"), py::arg("k_cache"), py::arg("v_cache"), py::arg("slots"),
        py::arg("pages"), py::arg("lengths"), py::arg("out"), py::arg("page_size"), py::arg("scale"),
        py::arg("softcap"), py::arg("window"), py::arg("rotate") = false, py::call_guard<py::gil_scoped_release>());
  m.def("write_kv", &write_kv, "a prompt step's new keys or values into their pages (CPU)", py::arg("src"),
        py::arg("cache"), py::arg("slots"), py::call_guard<py::gil_scoped_release>());
  m.def("write_kv_int8", &write_kv_int8, "quantize new keys/values into int8 pages (CPU)", py::arg("src"),
        py::arg("cache"), py::arg("slots"), py::arg("rotate") = false, py::arg("readback") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def("hadamard", &hadamard, "rows x [N, D] -> out = x H * scale (acb/kv_quant.py's key rotation) (CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("has_avx512", &has_avx512, "whether the one-call decode's AVX-512 items run (paged_decode_into: AVX-512, "
        "or AVX2 with head dims a multiple of 8: decode_into())");
  m.def("decode_into", &decode_into, "whether paged_decode_into runs (built with AVX-512, or AVX2 + FMA; "
        "elsewhere it returns false, doing nothing)");
  m.def("prefill_f32", &prefill_f32, "whether prefill_attention takes float32 q/k/v (built with AVX-512 or "
        "AVX2 + FMA; elsewhere it returns false)");
  m.def("prefill_bf16", &prefill_bf16, "whether prefill_attention takes bfloat16 q/k/v (built with avx512_bf16)");
  m.def("prefill_attention", &prefill_attention, "causal prefill attention of prompt chunks (CPU)", py::arg("q"),
        py::arg("k"), py::arg("v"), py::arg("spans"), py::arg("out"), py::arg("scale"), py::arg("softcap"),
        py::arg("window"), py::arg("bf16_weights") = false, py::call_guard<py::gil_scoped_release>());
}

void bind_int8(py::module_ m) {
  using namespace acb::int8;
  m.def("has_vnni", &has_vnni, "whether the GEMMs were built with AVX-512 VNNI");
  m.def("available", &available, "whether the GEMMs were built (AVX-512 VNNI, or AVX2)");
  m.def("quantize_rows", &quantize_rows, "per-row (per-group) int8 quantization, optionally after an RMSNorm",
        py::arg("x"), py::arg("norm_w") = py::none(), py::arg("gemma") = false, py::arg("eps") = 1e-6,
        py::arg("group") = 0, py::arg("mult") = py::none(), py::arg("rotate") = false,
        py::call_guard<py::gil_scoped_release>());
  m.def("linear", &linear, "W8A8 linear (+ residual)", py::arg("xq"), py::arg("xscale"), py::arg("xoff"),
        py::arg("w"), py::arg("scale"), py::arg("bias") = py::none(), py::arg("other") = py::none(),
        py::arg("dtype") = torch::kFloat32, py::call_guard<py::gil_scoped_release>());
  m.def("glu", &glu, "W8A8 act(x Wg) * (x Wu)", py::call_guard<py::gil_scoped_release>());
  py::class_<DecodeLoop>(m, "DecodeLoop", py::module_local(),
                         "a decode-only step's layers in one call (Int8Forward's loop)")
      .def(py::init<torch::ScalarType>(), py::arg("dtype"))
      .def("add_layer", &DecodeLoop::add_layer)
      .def("__len__", &DecodeLoop::size)
      .def_property("split_rows", &DecodeLoop::split_rows, &DecodeLoop::set_split_rows,
                    "the fewest rows a step runs as two halves, one per thread, on two threads (0: never)")
      .def_property_readonly("split_steps", &DecodeLoop::split_steps, "the steps run as two halves so far")
      .def("run", &DecodeLoop::run, py::call_guard<py::gil_scoped_release>());
}

void bind_bf16(py::module_ m) {
  using namespace acb::bf16;
  m.def("available", &available, "whether the GEMMs were built (AVX-512 BF16, or AVX2: widened to float32)");
  m.def("native", &native, "whether they were built with AVX-512 BF16 (vdpbf16ps), not widened");
  m.def("pack", &pack, "a bf16 [N, K] weight in the GEMMs' layout", py::call_guard<py::gil_scoped_release>());
  m.def("linear", &linear, "bf16 linear, float32 accumulation, float32 or bf16 output (+ residual)", py::arg("x"),
        py::arg("w"), py::arg("n"), py::arg("bias") = py::none(), py::arg("other") = py::none(),
        py::arg("dtype") = torch::kFloat32, py::call_guard<py::gil_scoped_release>());
  m.def("glu", &glu, "act(x Wg) * (x Wu) in one pass, float32 until the product is stored", py::arg("x"),
        py::arg("w"), py::arg("n"), py::arg("bias") = py::none(), py::arg("act") = 0,
        py::arg("dtype") = torch::kBFloat16, py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm", &rms_norm, "RMSNorm of float32 rows into bfloat16", py::arg("x"), py::arg("w"), py::arg("eps"),
        py::arg("gemma") = false, py::call_guard<py::gil_scoped_release>());
  py::class_<DecodeLoop>(m, "DecodeLoop", py::module_local(),
                         "a decode-only step's layers in one call (FusedForward's loop, bf16)")
      .def(py::init<>())
      .def("add_layer", &DecodeLoop::add_layer)
      .def("__len__", &DecodeLoop::size)
      .def_property("split_rows", &DecodeLoop::split_rows, &DecodeLoop::set_split_rows,
                    "the fewest rows a step runs as two halves, one per thread, on two threads (0: never)")
      .def_property_readonly("split_steps", &DecodeLoop::split_steps, "the steps run as two halves so far")
      .def("run", &DecodeLoop::run, py::call_guard<py::gil_scoped_release>());
}

void bind_lora(py::module_ m) {
  using namespace acb::lora;
  m.def("available", &available, "whether the kernels were built with AVX-512");
  m.def("add_", &add_, "LoRA deltas of the projections sharing x, per row group, in place",
        py::call_guard<py::gil_scoped_release>());
  m.def("glu_add", &glu_add, "act(g + gate delta) * (u + up delta), per row group",
        py::call_guard<py::gil_scoped_release>());
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  bind_fused(m.def_submodule("fused", "fused_cpu.cpp: the fused forward's elementwise ops"));
  bind_attention(m.def_submodule("attention", "paged_decode_cpu.cpp: attention over the paged KV cache"));
  bind_int8(m.def_submodule("int8", "int8_cpu.cpp: W8A8 GEMMs and the activations' quantization"));
  bind_bf16(m.def_submodule("bf16", "bf16_cpu.cpp: bf16 GEMMs"));
  bind_lora(m.def_submodule("lora", "lora_cpu.cpp: LoRA deltas per row group"));
}
