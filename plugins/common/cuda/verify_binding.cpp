// Torch binding of the fused verify kernels: tensors in, raw pointers to verify.h out.
// Includes no CUDA header (the stream arrives from Python as an integer handle), so it
// also compiles against a CPU-only torch; the checks here guard memory safety, the
// Python side (specplug.common.cuda) decides whether the kernel may run at all.
#include <torch/extension.h>

#include <optional>

#include "verify.h"

namespace {

int32_t dtype_code(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return SPECPLUG_F32;
    case at::kBFloat16:
      return SPECPLUG_BF16;
    case at::kHalf:
      return SPECPLUG_F16;
    default:
      TORCH_CHECK(false, "target_probs must be float32, bfloat16 or float16, got ", t.scalar_type());
  }
  return -1;
}

void check_cuda(const at::Tensor& t, const at::Tensor& like, const char* name) {
  TORCH_CHECK(t.is_cuda() && t.device() == like.device(), name, " must be on ", like.device(), ", got ",
              t.device());
}

void check_long(const at::Tensor& t, const at::Tensor& like, const char* name, int64_t numel) {
  check_cuda(t, like, name);
  TORCH_CHECK(t.scalar_type() == at::kLong && t.is_contiguous() && t.numel() == numel, name,
              " must be a contiguous int64 tensor of ", numel, " elements, got ", t.scalar_type(), " ",
              t.sizes());
}

}  // namespace

// Verifies a batch of draft trees (see verify.h for the contract). Writes accepted_nodes
// [B, N], num_accepted [B], bonus_token [B] and tree_depth [B]; enqueued on `stream`
// (a cudaStream_t as an integer), no host synchronisation.
void verify(const at::Tensor& target, const std::optional<at::Tensor>& draft, const at::Tensor& candidates,
            const at::Tensor& parents, const std::optional<at::Tensor>& num_nodes,
            const std::optional<at::Tensor>& uniforms, const at::Tensor& accepted_nodes,
            const at::Tensor& num_accepted, const at::Tensor& bonus_token, const at::Tensor& tree_depth,
            const at::Tensor& workspace, int64_t method, int64_t mode, int64_t splits, int64_t stream) {
  TORCH_CHECK(target.is_cuda(), "target_probs must be a CUDA tensor");
  TORCH_CHECK(candidates.dim() == 2, "candidates must be [B, N], got ", candidates.sizes());
  const int64_t batch = candidates.size(0), nodes = candidates.size(1);
  const bool flat = target.dim() == 2;
  TORCH_CHECK(flat || (target.dim() == 3 && target.size(0) == batch && target.size(1) == nodes),
              "target_probs must be [B, N, V] or [sum(num_nodes), V], got ", target.sizes());
  TORCH_CHECK(target.stride(-1) == 1, "target_probs rows must be contiguous");
  TORCH_CHECK(!flat || num_nodes.has_value(), "flattened target_probs need num_nodes");
  check_long(candidates, target, "candidates", batch * nodes);
  check_long(parents, target, "parents", batch * nodes);
  if (num_nodes) check_long(*num_nodes, target, "num_nodes", batch);
  check_long(accepted_nodes, target, "accepted_nodes", batch * nodes);
  check_long(num_accepted, target, "num_accepted", batch);
  check_long(bonus_token, target, "bonus_token", batch);
  check_long(tree_depth, target, "tree_depth", batch);
  if (uniforms) {
    check_cuda(*uniforms, target, "uniforms");
    TORCH_CHECK(uniforms->scalar_type() == at::kFloat && uniforms->dim() == 2 && uniforms->size(0) == batch &&
                    uniforms->size(1) >= nodes && uniforms->stride(1) == 1,
                "uniforms must be float32 [B, >= N] with contiguous rows, got ", uniforms->scalar_type(), " ",
                uniforms->sizes());
  }
  if (draft) {
    check_cuda(*draft, target, "draft_probs");
    TORCH_CHECK(draft->scalar_type() == target.scalar_type() && draft->sizes() == target.sizes() &&
                    draft->strides() == target.strides(),
                "draft_probs must match target_probs in dtype, shape and strides");
  }
  const int64_t rows_stride = flat ? target.stride(0) : target.stride(1);
  const int64_t need = specplug_verify_workspace_bytes(static_cast<int32_t>(batch), static_cast<int32_t>(nodes),
                                                       static_cast<int32_t>(splits));
  TORCH_CHECK(workspace.is_cuda() && static_cast<int64_t>(workspace.nbytes()) >= need,
              "workspace too small: size it with workspace_bytes(B, N, splits)");

  SpecplugVerifyArgs a{};
  a.target = target.data_ptr();
  a.draft = draft ? draft->data_ptr() : nullptr;
  a.stride_b = flat ? 0 : target.stride(0);
  a.stride_n = rows_stride;
  a.total_rows = flat ? target.size(0) : batch * nodes;
  a.flat = flat ? 1 : 0;
  a.candidates = candidates.data_ptr<int64_t>();
  a.parents = parents.data_ptr<int64_t>();
  a.num_nodes = num_nodes ? num_nodes->data_ptr<int64_t>() : nullptr;
  a.uniforms = uniforms ? uniforms->data_ptr<float>() : nullptr;
  a.uniforms_stride = uniforms ? uniforms->stride(0) : 0;
  a.accepted_nodes = accepted_nodes.data_ptr<int64_t>();
  a.num_accepted = num_accepted.data_ptr<int64_t>();
  a.bonus_token = bonus_token.data_ptr<int64_t>();
  a.tree_depth = tree_depth.data_ptr<int64_t>();
  a.workspace = workspace.data_ptr();
  a.batch = static_cast<int32_t>(batch);
  a.nodes = static_cast<int32_t>(nodes);
  a.vocab = static_cast<int32_t>(target.size(-1));
  a.dtype = dtype_code(target);
  a.method = static_cast<int32_t>(method);
  a.mode = static_cast<int32_t>(mode);
  a.splits = static_cast<int32_t>(splits);
  const int err = specplug_verify_launch(&a, reinterpret_cast<void*>(stream));
  TORCH_CHECK(err == 0, "specplug verify kernel: ", specplug_verify_error_string(err));
}

int64_t workspace_bytes(int64_t batch, int64_t nodes, int64_t splits) {
  return specplug_verify_workspace_bytes(static_cast<int32_t>(batch), static_cast<int32_t>(nodes),
                                         static_cast<int32_t>(splits));
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "specplug fused tree-verification kernels";
  // Named arguments: Python passes them by keyword (tests check the names match).
  m.def("verify", &verify, "Verify a batch of draft trees on the GPU (see verify.h)", py::arg("target"),
        py::arg("draft"), py::arg("candidates"), py::arg("parents"), py::arg("num_nodes"), py::arg("uniforms"),
        py::arg("accepted_nodes"), py::arg("num_accepted"), py::arg("bonus_token"), py::arg("tree_depth"),
        py::arg("workspace"), py::arg("method"), py::arg("mode"), py::arg("splits"), py::arg("stream"));
  m.def("workspace_bytes", &workspace_bytes, "Scratch bytes verify needs for (batch, nodes, splits)",
        py::arg("batch"), py::arg("nodes"), py::arg("splits"));
  m.attr("MAX_NODES") = static_cast<int>(SPECPLUG_MAX_NODES);
  m.attr("MAX_VOCAB") = static_cast<int>(SPECPLUG_MAX_VOCAB);
  m.attr("GREEDY") = static_cast<int>(SPECPLUG_GREEDY);
  m.attr("TARGET_ONLY") = static_cast<int>(SPECPLUG_TARGET_ONLY);
  m.attr("DRAFT_REJECTION") = static_cast<int>(SPECPLUG_DRAFT_REJECTION);
  m.attr("MODE_ROWS") = static_cast<int>(SPECPLUG_MODE_ROWS);
  m.attr("MODE_PATH") = static_cast<int>(SPECPLUG_MODE_PATH);
}
