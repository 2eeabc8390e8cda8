// C interface of specplug's fused tree-verification kernels (verify_kernels.cu).
//
// Plain C types only, so that the torch binding (verify_binding.cpp) compiles without
// any CUDA header: the stream travels as a void* (a cudaStream_t, passed from Python).
//
// Contract (the same as specplug.common.sampling.verify; node 0 of each tree is the root):
//   candidates [B, N] int64     token at each node
//   parents    [B, N] int64     parent node id, -1 for the root; parents[i] < i
//   num_nodes  [B] int64        real nodes per request (NULL: all N are real)
//   target     [B, N, V] or flattened [sum(num_nodes), V]; row-contiguous
//   draft      same layout as target, or NULL (deterministic drafting)
//   uniforms   [B, >= N] float32: column 0 draws the final token, column j the
//              acceptance of node j (NULL for greedy); "coupled": column d is the
//              draw of every token after a node of depth d
//   outputs:   accepted_nodes [B, N] int64 (root -> last accepted, -1 padded),
//              num_accepted [B] int64, bonus_token [B] int64, tree_depth [B] int64
//              (depth of the deepest real node: the torch path returns
//              accepted_nodes[:, :max(tree_depth) + 1])
#ifndef SPECPLUG_VERIFY_H_
#define SPECPLUG_VERIFY_H_

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum SpecplugDtype { SPECPLUG_F32 = 0, SPECPLUG_BF16 = 1, SPECPLUG_F16 = 2 };

enum SpecplugMethod {
  SPECPLUG_GREEDY = 0,           // argmax walk
  SPECPLUG_TARGET_ONLY = 1,      // "rejection" without draft probs (EAGLE / SGLang rule)
  SPECPLUG_DRAFT_REJECTION = 2,  // "rejection" with draft probs (Leviathan / SpecInfer)
  SPECPLUG_COUPLED = 3,          // "coupled": inverse-CDF walk with the draw of each depth (path mode only)
};

enum SpecplugMode {
  SPECPLUG_MODE_ROWS = 0,  // reduce every real row in parallel, then one block walks
  SPECPLUG_MODE_PATH = 1,  // one block per request reduces only the rows it visits
};

// Limits checked by the launcher (larger inputs take the torch path).
enum { SPECPLUG_MAX_NODES = 1024, SPECPLUG_MAX_VOCAB = 262144 };

typedef struct SpecplugVerifyArgs {
  const void* target;        // p: probabilities (or logits for greedy)
  const void* draft;         // q: same dtype, layout and strides as target, or NULL
  int64_t stride_b;          // elements between requests (padded layout only)
  int64_t stride_n;          // elements between rows
  int64_t total_rows;        // rows in the flattened layout (ignored when padded)
  int32_t flat;              // 1: target is [sum(num_nodes), V]
  const int64_t* candidates;
  const int64_t* parents;
  const int64_t* num_nodes;  // NULL: N for every request
  const float* uniforms;     // NULL for greedy
  int64_t uniforms_stride;   // elements between requests in uniforms
  int64_t* accepted_nodes;
  int64_t* num_accepted;
  int64_t* bonus_token;
  int64_t* tree_depth;       // may be NULL
  void* workspace;           // specplug_verify_workspace_bytes(...) bytes, any content
  int32_t batch, nodes, vocab;
  int32_t dtype, method, mode;
  int32_t splits;            // blocks per row in SPECPLUG_MODE_ROWS (>= 1)
} SpecplugVerifyArgs;

// Bytes of scratch the launch needs (counters + per-block partial results).
int64_t specplug_verify_workspace_bytes(int32_t batch, int32_t nodes, int32_t splits);

// Enqueues the verification on `stream` (a cudaStream_t): one memset and one kernel
// launch, no host synchronisation. Returns 0, a cudaError_t, or a negative code for
// bad arguments (see specplug_verify_error_string).
int specplug_verify_launch(const SpecplugVerifyArgs* args, void* stream);

const char* specplug_verify_error_string(int code);

#ifdef __cplusplus
}
#endif

#endif  // SPECPLUG_VERIFY_H_
