// Test support, not product code: runs specplug_verify_launch under the CPU emulator
// (cuda_emu.h) on inputs written by tests/cuda/emulate.py.
//   driver DIR   reads DIR/meta.txt and DIR/*.bin, writes DIR/out.bin
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "verify.h"

namespace {

std::vector<char> read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) {
    std::fprintf(stderr, "driver: cannot read %s\n", path.c_str());
    std::exit(2);
  }
  return std::vector<char>((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

// A copy of `bytes` at a 64-byte aligned address plus `offset` bytes.
char* placed(const std::vector<char>& bytes, long offset, std::vector<char>& keep) {
  keep.assign(bytes.size() + 128, 0);
  uintptr_t base = (reinterpret_cast<uintptr_t>(keep.data()) + 63) & ~uintptr_t(63);
  char* at = reinterpret_cast<char*>(base) + offset;
  std::copy(bytes.begin(), bytes.end(), at);
  return at;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  const std::string dir = argv[1];
  long batch, nodes, vocab, dtype, method, mode, splits, flat, total_rows, has_num, has_u, has_draft, u_stride,
      stride_b, stride_n, offset;
  std::ifstream meta(dir + "/meta.txt");
  meta >> batch >> nodes >> vocab >> dtype >> method >> mode >> splits >> flat >> total_rows >> has_num >> has_u >>
      has_draft >> u_stride >> stride_b >> stride_n >> offset;
  if (!meta) return 3;
  std::vector<char> keep_t, keep_d;
  auto target = read_file(dir + "/target.bin");
  auto candidates = read_file(dir + "/candidates.bin");
  auto parents = read_file(dir + "/parents.bin");
  std::vector<char> num_nodes, uniforms, draft;
  if (has_num) num_nodes = read_file(dir + "/num_nodes.bin");
  if (has_u) uniforms = read_file(dir + "/uniforms.bin");
  if (has_draft) draft = read_file(dir + "/draft.bin");

  std::vector<int64_t> accepted(batch * nodes, -7), num_accepted(batch, -7), bonus(batch, -7), depth(batch, -7);
  SpecplugVerifyArgs a{};
  a.target = placed(target, offset, keep_t);
  a.draft = has_draft ? placed(draft, offset, keep_d) : nullptr;
  a.stride_b = stride_b;
  a.stride_n = stride_n;
  a.total_rows = total_rows;
  a.flat = static_cast<int32_t>(flat);
  a.candidates = reinterpret_cast<const int64_t*>(candidates.data());
  a.parents = reinterpret_cast<const int64_t*>(parents.data());
  a.num_nodes = has_num ? reinterpret_cast<const int64_t*>(num_nodes.data()) : nullptr;
  a.uniforms = has_u ? reinterpret_cast<const float*>(uniforms.data()) : nullptr;
  a.uniforms_stride = u_stride;
  a.accepted_nodes = accepted.data();
  a.num_accepted = num_accepted.data();
  a.bonus_token = bonus.data();
  a.tree_depth = depth.data();
  std::vector<char> workspace(specplug_verify_workspace_bytes(batch, nodes, splits) + 64, 0x5a);
  a.workspace = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(workspace.data()) + 63) & ~uintptr_t(63));
  a.batch = batch;
  a.nodes = nodes;
  a.vocab = vocab;
  a.dtype = dtype;
  a.method = method;
  a.mode = mode;
  a.splits = splits;
  const int err = specplug_verify_launch(&a, nullptr);
  if (err) {
    std::fprintf(stderr, "driver: %s\n", specplug_verify_error_string(err));
    return 4;
  }
  std::ofstream out(dir + "/out.bin", std::ios::binary);
  for (auto* v : {&accepted, &num_accepted, &bonus, &depth})
    out.write(reinterpret_cast<const char*>(v->data()), v->size() * sizeof(int64_t));
  return 0;
}
