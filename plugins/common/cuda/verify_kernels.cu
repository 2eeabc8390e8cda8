// Fused tree verification for speculative decoding (greedy, target-only rejection,
// draft-probability rejection), one launch per batch; the C interface is verify.h.
//
// The torch implementation, specplug.common.sampling.verify, is the reference, and this
// file follows its arithmetic step by step so that, given the same uniforms, both return
// the same tokens: decisions use its float32 operations (IEEE division, no contraction),
// row sums are accumulated in float64 and rounded to float32, and the final token is
// sample_inverse_cdf's: cdf = float32 cumsum (accumulated in float64 and rounded per
// entry, as torch's CPU cumsum does), the first v with cdf[v] > float32(u * cdf[-1]).
// Where the reference's own float32 reductions are order-dependent (torch does not fix
// their order), a draw within float32 rounding of a boundary can differ; on inputs whose
// sums are exact (dyadic probabilities) the results are identical.
//
// Two schedules (SpecplugMode):
//   ROWS  grid (splits, N, B): every block reduces one part of one real row (argmax for
//         greedy, mass for target-only) into the workspace; the last block of a request
//         to finish (atomic counter) walks the tree with those results.
//   PATH  grid (1, 1, B): one block per request walks the tree and reduces only the
//         rows it visits (fewer bytes; better when B * N is large). The draft rule
//         always runs this way.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <climits>
#include <math.h>
#include <stdint.h>

#include "verify.h"

namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kUnroll = 4;  // 16-byte loads in flight per thread per row
constexpr int kMaxNodes = SPECPLUG_MAX_NODES;
constexpr int kMaxVocab = SPECPLUG_MAX_VOCAB;
constexpr int kSlotsPerLane = 4;                     // ordered pass: consecutive slots per lane
constexpr int kTileSlots = 32 * kSlotsPerLane;       // ordered pass: slots per warp tile
constexpr int kMaxTiles = (kMaxVocab / 4 + 2 + kTileSlots - 1) / kTileSlots;  // fp32 worst case
constexpr int64_t kCounterBytes = 256;               // alignment of the counter block
constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

// Elements p[0..cnt), cnt < 16 / sizeof(T), as the 16 raw bytes of a slot, zero-filled
// (registers only: no local-memory array).
__device__ __forceinline__ uint4 load_partial(const float* p, int cnt) {
  const unsigned* w = reinterpret_cast<const unsigned*>(p);
  return make_uint4(cnt > 0 ? __ldg(w) : 0u, cnt > 1 ? __ldg(w + 1) : 0u, cnt > 2 ? __ldg(w + 2) : 0u,
                    cnt > 3 ? __ldg(w + 3) : 0u);
}

template <typename T>  // 2-byte elements (bf16, fp16); little-endian packing
__device__ __forceinline__ uint4 load_partial(const T* p, int cnt) {
  const unsigned short* e = reinterpret_cast<const unsigned short*>(p);
  unsigned w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const unsigned lo = 2 * i < cnt ? __ldg(e + 2 * i) : 0u;
    const unsigned hi = 2 * i + 1 < cnt ? __ldg(e + 2 * i + 1) : 0u;
    w[i] = lo | (hi << 16);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// ---------------------------------------------------------------------------------
// A row of V elements seen as "slots": slot 0 holds the elements before the first
// 16-byte boundary, slots 1..nvec are aligned 16-byte vectors, slot nvec+1 the rest.
// Slot order is vocabulary order.
template <typename T>
struct Row {
  static constexpr int kVec = 16 / sizeof(T);
  const T* ptr;
  int vocab;
  int head;
  int nvec;

  __device__ Row(const T* p, int v) : ptr(p), vocab(v) {
    const unsigned mis = static_cast<unsigned>(reinterpret_cast<uintptr_t>(p) & 15u);
    const int h = static_cast<int>(((16u - mis) & 15u) / sizeof(T));
    head = h < v ? h : v;
    nvec = (v - head) / kVec;
  }
  __device__ int num_slots() const { return nvec + 2; }
  __device__ int slot_begin(int s) const {
    return s == 0 ? 0 : head + (s <= nvec ? s - 1 : nvec) * kVec;
  }
  __device__ int slot_count(int s) const {
    if (s == 0) return head;
    if (s <= nvec) return kVec;
    return s == nvec + 1 ? vocab - head - nvec * kVec : 0;
  }
  __device__ int slot_of(int v) const {
    if (v < head) return 0;
    const int k = (v - head) / kVec;
    return k < nvec ? k + 1 : nvec + 1;
  }
  __device__ const uint4* body() const { return reinterpret_cast<const uint4*>(ptr + head); }
  __device__ float at(int v) const { return to_float(__ldg(ptr + v)); }
  // The raw 16 bytes of slot s; elements past slot_count(s) are zero bits (+0.0).
  __device__ uint4 load_raw(int s) const {
    if (s >= 1 && s <= nvec) return __ldg(body() + (s - 1));
    return load_partial(ptr + slot_begin(s), slot_count(s));
  }
};

template <typename T>
__device__ __forceinline__ void unpack(const uint4& raw, float (&x)[Row<T>::kVec]) {
  const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < Row<T>::kVec; ++i) x[i] = to_float(e[i]);
}

// Calls f(v0, count, xp, xq) for every slot in part `part` of `parts` of the row, in
// no particular order (xq is zeros without kHasQ). Loads are 16 bytes, kUnroll deep.
template <typename T, bool kHasQ, typename F>
__device__ void visit(const Row<T>& p, const Row<T>& q, int part, int parts, F& f) {
  constexpr int kVec = Row<T>::kVec;
  float xp[kVec];
  float xq[kVec] = {};
  if (part == 0 && threadIdx.x < 2) {  // head and tail slots
    const int s = threadIdx.x == 0 ? 0 : p.nvec + 1;
    const int cnt = p.slot_count(s);
    if (cnt > 0) {
      unpack<T>(p.load_raw(s), xp);
      if (kHasQ) unpack<T>(q.load_raw(s), xq);
      f(p.slot_begin(s), cnt, xp, xq);
    }
  }
  const int per = (p.nvec + parts - 1) / parts;
  const int lo = part * per;
  const int hi = min(p.nvec, lo + per);
  int i = lo + static_cast<int>(threadIdx.x);
  for (; i + (kUnroll - 1) * kThreads < hi; i += kUnroll * kThreads) {
    uint4 rp[kUnroll];
    uint4 rq[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      rp[k] = __ldg(p.body() + i + k * kThreads);
      if (kHasQ) rq[k] = __ldg(q.body() + i + k * kThreads);
    }
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      unpack<T>(rp[k], xp);
      if (kHasQ) unpack<T>(rq[k], xq);
      f(p.head + (i + k * kThreads) * kVec, kVec, xp, xq);
    }
  }
  for (; i < hi; i += kThreads) {
    unpack<T>(__ldg(p.body() + i), xp);
    if (kHasQ) unpack<T>(__ldg(q.body() + i), xq);
    f(p.head + i * kVec, kVec, xp, xq);
  }
}

// ---------------------------------------------------------------------------------
// Block-wide reductions. Every thread gets the same result (same operand order).
struct ArgMax {
  float val;
  int idx;
};

// torch.argmax order: larger value first, NaN above everything, ties to the lower index.
__device__ __forceinline__ bool better(float v1, int i1, float v2, int i2) {
  const bool n1 = isnan(v1), n2 = isnan(v2);
  if (n1 || n2) return n1 && (!n2 || i1 < i2);
  return v1 > v2 || (v1 == v2 && i1 < i2);
}
__device__ __forceinline__ ArgMax pick(ArgMax a, ArgMax b) {
  return better(b.val, b.idx, a.val, a.idx) ? b : a;
}
__device__ __forceinline__ ArgMax shfl_xor(ArgMax a, int o) {
  return ArgMax{__shfl_xor_sync(kFullMask, a.val, o), __shfl_xor_sync(kFullMask, a.idx, o)};
}
__device__ __forceinline__ double shfl_xor(double a, int o) { return __shfl_xor_sync(kFullMask, a, o); }
__device__ __forceinline__ long long shfl_xor(long long a, int o) {
  return __shfl_xor_sync(kFullMask, a, o);
}
__device__ __forceinline__ int shfl_xor(int a, int o) { return __shfl_xor_sync(kFullMask, a, o); }

struct Add {
  template <typename V>
  __device__ V operator()(V a, V b) const { return a + b; }
};
struct Min {
  __device__ int operator()(int a, int b) const { return a < b ? a : b; }
};
struct Pick {
  __device__ ArgMax operator()(ArgMax a, ArgMax b) const { return pick(a, b); }
};

template <typename V, typename Op>
__device__ V block_reduce(V v, V* scratch, Op op) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = op(v, shfl_xor(v, o));
  __syncthreads();  // scratch may still be read by a previous reduction
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
  __syncthreads();
  V total = scratch[0];
  for (int w = 1; w < kWarps; ++w) total = op(total, scratch[w]);
  return total;
}

// Exclusive prefix sum over the block (thread order); *total gets the block sum.
__device__ double block_exclusive_scan(double v, double* scratch, double* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  double incl = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const double up = __shfl_up_sync(kFullMask, incl, o);
    if (lane >= o) incl += up;
  }
  double excl = __shfl_up_sync(kFullMask, incl, 1);
  if (lane == 0) excl = 0.0;
  __syncthreads();
  if (lane == 31) scratch[warp] = incl;
  __syncthreads();
  double before = 0.0, all = 0.0;
  for (int w = 0; w < kWarps; ++w) {
    if (w < warp) before += scratch[w];
    all += scratch[w];
  }
  *total = all;
  return before + excl;
}

struct Max {
  __device__ int operator()(int a, int b) const { return a > b ? a : b; }
};

// ---------------------------------------------------------------------------------
struct Smem {
  int cand[kMaxNodes];  // token of each node (-1: outside the vocabulary)
  int par[kMaxNodes];   // parent of each node
  int path[kMaxNodes];  // accepted node ids, root first
  union {
    struct {
      int depth[kMaxNodes];  // depth of nodes on agreeing paths, -1 elsewhere
      int top[kMaxNodes];    // target argmax after each agreeing node
    } greedy;
    struct {
      int rej[kMaxNodes];         // target-only: tokens rejected at the current node
      float norm[kMaxNodes + 1];  // draft rule: p_sum, then each residual's normaliser
    } sampled;
  } m;
  double tile[kMaxTiles];  // inverse-CDF draw: mass of each warp tile
  double scratch_d[kWarps];
  long long scratch_l[kWarps];
  ArgMax scratch_a[kWarps];
  int scratch_i[kWarps];
  double base;
  int flag;
};

union Partial {
  double mass;
  ArgMax best;
};

struct Request {
  int b;
  int n;           // real nodes, clamped to the tensors
  int64_t row0;    // element offset of the request's row 0
  int64_t stride;  // elements between its rows
};

__device__ Request load_request(const SpecplugVerifyArgs& a, Smem& sm) {
  Request r;
  r.b = blockIdx.z;
  long long n = a.num_nodes ? a.num_nodes[r.b] : a.nodes;
  r.stride = a.stride_n;
  if (a.flat) {
    long long before = static_cast<long long>(r.b) * a.nodes;
    if (a.num_nodes) {
      long long mine = 0;
      for (int i = threadIdx.x; i < r.b; i += kThreads) mine += a.num_nodes[i];
      before = block_reduce(mine, sm.scratch_l, Add());
    }
    r.row0 = before * a.stride_n;
    if (n > a.total_rows - before) n = a.total_rows - before;
  } else {
    r.row0 = static_cast<int64_t>(r.b) * a.stride_b;
  }
  if (n > a.nodes) n = a.nodes;
  r.n = n < 0 ? 0 : static_cast<int>(n);
  return r;
}

template <typename T>
__device__ Row<T> row_of(const void* base, const Request& r, int j, int vocab) {
  return Row<T>(static_cast<const T*>(base) + r.row0 + static_cast<int64_t>(j) * r.stride, vocab);
}

// Smallest node c >= from with parents[c] == cur; -1 if none. Block-uniform.
__device__ int next_child(const Smem& sm, int cur, int from, int n) {
  const int lane = threadIdx.x & 31;
  for (int base = from; base < n; base += 32) {
    const int c = base + lane;
    const unsigned m = __ballot_sync(kFullMask, c < n && sm.par[c] == cur);
    if (m) return base + __ffs(m) - 1;
  }
  return -1;
}

// Smallest node c >= from with marks[c] >= 0; -1 if none. Block-uniform.
__device__ int next_marked(const int* marks, int from, int n) {
  const int lane = threadIdx.x & 31;
  for (int base = from; base < n; base += 32) {
    const int c = base + lane;
    const unsigned m = __ballot_sync(kFullMask, c < n && marks[c] >= 0);
    if (m) return base + __ffs(m) - 1;
  }
  return -1;
}

__device__ __forceinline__ bool in_list(const int* list, int count, int x) {
  for (int i = 0; i < count; ++i)
    if (list[i] == x) return true;
  return false;
}

// ---------------------------------------------------------------------------------
// Row reductions (one part of a row; parts = 1 reduces the whole row).
template <typename T>
__device__ ArgMax row_argmax(const Row<T>& p, int part, int parts, Smem& sm) {
  ArgMax best{-INFINITY, INT_MAX};
  auto f = [&](int v0, int cnt, const float(&xp)[Row<T>::kVec], const float(&)[Row<T>::kVec]) {
#pragma unroll
    for (int i = 0; i < Row<T>::kVec; ++i)
      if (i < cnt && better(xp[i], v0 + i, best.val, best.idx)) best = ArgMax{xp[i], v0 + i};
  };
  visit<T, false>(p, p, part, parts, f);
  return block_reduce(best, sm.scratch_a, Pick());
}

template <typename T>
__device__ double row_mass(const Row<T>& p, int part, int parts, Smem& sm) {
  double acc = 0.0;
  auto f = [&](int, int cnt, const float(&xp)[Row<T>::kVec], const float(&)[Row<T>::kVec]) {
#pragma unroll
    for (int i = 0; i < Row<T>::kVec; ++i)
      if (i < cnt) acc += static_cast<double>(xp[i]);
  };
  visit<T, false>(p, p, part, parts, f);
  return block_reduce(acc, sm.scratch_d, Add());
}

// Draft rule: p_res after k rejections at a node, in the reference's float32 steps:
// r_0 = p / p_sum, r_i = max(r_{i-1} - q, 0) / max(s_i, 1e-30) where s_i > 0, else
// r_i = r_{i-1}. norm[0] = p_sum, norm[i] = s_i.
__device__ __forceinline__ float residual(float p, float q, const float* norm, int k) {
  float r = __fdiv_rn(p, norm[0]);
  for (int i = 1; i <= k; ++i)
    if (norm[i] > 0.0f) r = __fdiv_rn(fmaxf(__fsub_rn(r, q), 0.0f), fmaxf(norm[i], 1e-30f));
  return r;
}

// sum_v max(r_k(v) - q(v), 0): the normaliser s_{k+1}.
template <typename T>
__device__ double residual_mass(const Row<T>& p, const Row<T>& q, int k, Smem& sm) {
  double acc = 0.0;
  const float* norm = sm.m.sampled.norm;
  auto f = [&](int, int cnt, const float(&xp)[Row<T>::kVec], const float(&xq)[Row<T>::kVec]) {
#pragma unroll
    for (int i = 0; i < Row<T>::kVec; ++i) {
      if (i < cnt) acc += static_cast<double>(fmaxf(__fsub_rn(residual(xp[i], xq[i], norm, k), xq[i]), 0.0f));
    }
  };
  visit<T, true>(p, q, 0, 1, f);
  return block_reduce(acc, sm.scratch_d, Add());
}

struct Plain {
  __device__ float operator()(float p, float) const { return p; }
};

struct Residual {
  const float* norm;
  int k;
  __device__ float operator()(float p, float q) const { return residual(p, q, norm, k); }
};

// ---------------------------------------------------------------------------------
// Inverse-CDF draw, the reference's sample_inverse_cdf: cdf = float32 cumsum of the
// weights w (accumulated in float64 and rounded per entry, as torch does on the CPU),
// target = float32(u * cdf[-1]); the result is the first v with cdf[v] > target, or
// vocab - 1 when none. w(v) = xf(p(v), q(v)), and 0 for the `nrej` tokens in `rej`.

// Weights of kSlotsPerLane consecutive slots from s0 in vocabulary order; returns their
// mass. With `hit`: the first v with float(start + running mass) > target.
template <typename T, bool kHasQ, typename Xf>
__device__ double lane_slots_mass(const Row<T>& p, const Row<T>& q, const Xf& xf, const int* rej, int nrej,
                                  int s0, int slots, double start, float target, int* hit) {
  constexpr int kVec = Row<T>::kVec;
  double mass = 0.0;
  double run = start;
#pragma unroll
  for (int k = 0; k < kSlotsPerLane; ++k) {
    const int s = s0 + k < slots ? s0 + k : slots;
    const int v0 = p.slot_begin(s), cnt = p.slot_count(s);
    float xp[kVec];
    float xq[kVec] = {};
    unpack<T>(p.load_raw(s), xp);
    if (kHasQ) unpack<T>(q.load_raw(s), xq);
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      float x = i < cnt ? xf(xp[i], xq[i]) : 0.0f;
      if (in_list(rej, nrej, v0 + i)) x = 0.0f;
      mass += static_cast<double>(x);
      run += static_cast<double>(x);
      if (hit && *hit < 0 && x > 0.0f && static_cast<float>(run) > target) *hit = v0 + i;
    }
  }
  return mass;
}

template <typename T, bool kHasQ, typename Xf>
__device__ int sample_row(const Row<T>& p, const Row<T>& q, float u, const Xf& xf, const int* rej, int nrej,
                          Smem& sm) {
  constexpr int kVec = Row<T>::kVec;
  const int slots = p.num_slots();
  const int tiles = (slots + kTileSlots - 1) / kTileSlots;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

  // 1. Mass of every tile of kTileSlots slots (lanes strided: coalesced).
  for (int t = warp; t < tiles; t += kWarps) {
    uint4 rp[kSlotsPerLane];
    uint4 rq[kSlotsPerLane];
#pragma unroll
    for (int k = 0; k < kSlotsPerLane; ++k) {
      const int s = t * kTileSlots + k * 32 + lane;
      rp[k] = p.load_raw(s < slots ? s : slots);  // slot `slots` is empty: zeros
      if (kHasQ) rq[k] = q.load_raw(s < slots ? s : slots);
    }
    double acc = 0.0;
#pragma unroll
    for (int k = 0; k < kSlotsPerLane; ++k) {
      const int s = t * kTileSlots + k * 32 + lane;
      const int cnt = s < slots ? p.slot_count(s) : 0;
      float xp[kVec];
      float xq[kVec] = {};
      unpack<T>(rp[k], xp);
      if (kHasQ) unpack<T>(rq[k], xq);
#pragma unroll
      for (int i = 0; i < kVec; ++i)
        if (i < cnt) acc += static_cast<double>(xf(xp[i], xq[i]));
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc += shfl_xor(acc, o);
    if (lane == 0) sm.tile[t] = acc;
  }
  __syncthreads();
  if (threadIdx.x == 0) {  // masked tokens leave their tile
    for (int i = 0; i < nrej; ++i) {
      const int x = rej[i];
      const float w = xf(p.at(x), kHasQ ? q.at(x) : 0.0f);
      sm.tile[p.slot_of(x) / kTileSlots] -= static_cast<double>(w);
    }
  }
  __syncthreads();

  // 2. Prefix over tiles; the first tile whose inclusive prefix passes the target.
  const int per = (tiles + kThreads - 1) / kThreads;
  const int t_lo = threadIdx.x * per, t_hi = min(tiles, t_lo + per);
  double mine = 0.0;
  for (int t = t_lo; t < t_hi; ++t) mine += sm.tile[t];
  double total;
  double running = block_exclusive_scan(mine, sm.scratch_d, &total);
  const float target = __fmul_rn(u, static_cast<float>(total));
  int first = INT_MAX;
  double first_base = 0.0;
  for (int t = t_lo; t < t_hi && first == INT_MAX; ++t) {
    if (static_cast<float>(running + sm.tile[t]) > target) {
      first = t;
      first_base = running;
    }
    running += sm.tile[t];
  }
  const int t0 = block_reduce(first, sm.scratch_i, Min());
  if (first == t0 && t0 != INT_MAX) sm.base = first_base;
  __syncthreads();

  // 3. Warp 0 scans from tile t0 in vocabulary order (lane l owns slots 4l..4l+3).
  if (warp == 0) {
    int found = -1;
    double base = t0 != INT_MAX ? sm.base : 0.0;
    for (int t = t0; t < tiles && found < 0; ++t) {
      const int s0 = t * kTileSlots + lane * kSlotsPerLane;
      const double lane_mass = lane_slots_mass<T, kHasQ>(p, q, xf, rej, nrej, s0, slots, 0.0, target, nullptr);
      double incl = lane_mass;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const double up = __shfl_up_sync(kFullMask, incl, o);
        if (lane >= o) incl += up;
      }
      const double before = __shfl_up_sync(kFullMask, incl, 1);
      int hit = -1;
      lane_slots_mass<T, kHasQ>(p, q, xf, rej, nrej, s0, slots, base + (lane == 0 ? 0.0 : before), target, &hit);
      const unsigned m = __ballot_sync(kFullMask, hit >= 0);
      if (m) found = __shfl_sync(kFullMask, hit, __ffs(m) - 1);
      base += __shfl_sync(kFullMask, incl, 31);
    }
    if (lane == 0) sm.flag = found >= 0 ? found : p.vocab - 1;
  }
  __syncthreads();
  const int token = sm.flag;
  __syncthreads();
  return token;
}

// ---------------------------------------------------------------------------------
// Walks. Every decision is block-uniform (all threads read the same values). A walk
// ends at `final`, the last accepted node; its ancestors are the accepted path.
struct Walk {
  int final = 0;
  int depth = 0;
  int bonus = -1;
};

__device__ __forceinline__ float uniform(const SpecplugVerifyArgs& a, int b, int col) {
  return __ldg(a.uniforms + static_cast<int64_t>(b) * a.uniforms_stride + col);
}

__device__ __forceinline__ int64_t counter_bytes(int batch) {
  return (static_cast<int64_t>(batch) * 4 + kCounterBytes - 1) / kCounterBytes * kCounterBytes;
}

__device__ __forceinline__ Partial* partials(const SpecplugVerifyArgs& a, int b, int j) {
  char* ws = static_cast<char*>(a.workspace) + counter_bytes(a.batch);
  return reinterpret_cast<Partial*>(ws) + (static_cast<int64_t>(b) * a.nodes + j) * a.splits;
}

template <typename T>
__device__ int argmax_of(const SpecplugVerifyArgs& a, const Request& r, int j, Smem& sm) {
  if (a.mode == SPECPLUG_MODE_PATH) return row_argmax(row_of<T>(a.target, r, j, a.vocab), 0, 1, sm).idx;
  const Partial* part = partials(a, r.b, j);
  ArgMax best{-INFINITY, INT_MAX};
  for (int s = threadIdx.x; s < a.splits; s += kThreads)
    best = pick(best, ArgMax{__ldcg(&part[s].best.val), __ldcg(&part[s].best.idx)});
  return block_reduce(best, sm.scratch_a, Pick()).idx;
}

template <typename T>
__device__ double mass_of(const SpecplugVerifyArgs& a, const Request& r, int j, Smem& sm) {
  if (a.mode == SPECPLUG_MODE_PATH) return row_mass(row_of<T>(a.target, r, j, a.vocab), 0, 1, sm);
  const Partial* part = partials(a, r.b, j);
  double acc = 0.0;
  for (int s = threadIdx.x; s < a.splits; s += kThreads) acc += __ldcg(&part[s].mass);
  return block_reduce(acc, sm.scratch_d, Add());
}

// The target's token after node j (at depth d): its argmax (greedy), or its inverse-CDF
// draw with the uniform of depth d ("coupled", the reference's sample_inverse_cdf).
template <typename T, int kMethod>
__device__ int token_after(const SpecplugVerifyArgs& a, const Request& r, int j, int d, Smem& sm) {
  if (kMethod == SPECPLUG_COUPLED) {
    const Row<T> p = row_of<T>(a.target, r, j, a.vocab);
    return sample_row<T, false>(p, p, uniform(a, r.b, d), Plain(), nullptr, 0, sm);
  }
  return argmax_of<T>(a, r, j, sm);
}

// Greedy and "coupled": the deepest root path whose every token is the target's token
// after its parent (token_after; ties: lowest node id); bonus = the token after it.
// Reduces the rows of every node on an agreeing path (a single path unless siblings
// repeat a token).
template <typename T, int kMethod>
__device__ Walk walk_agreeing(const SpecplugVerifyArgs& a, const Request& r, Smem& sm) {
  int* depth = sm.m.greedy.depth;
  int* top = sm.m.greedy.top;
  for (int i = threadIdx.x; i < r.n; i += kThreads) depth[i] = i == 0 ? 0 : -1;
  __syncthreads();
  for (int j = next_marked(depth, 0, r.n); j >= 0; j = next_marked(depth, j + 1, r.n)) {
    const int t = token_after<T, kMethod>(a, r, j, depth[j], sm);
    for (int c = j + 1 + threadIdx.x; c < r.n; c += kThreads)
      if (sm.par[c] == j && sm.cand[c] == t) depth[c] = depth[j] + 1;
    if (threadIdx.x == 0) top[j] = t;
    __syncthreads();
  }
  ArgMax deepest{-INFINITY, INT_MAX};
  for (int i = threadIdx.x; i < r.n; i += kThreads)
    if (depth[i] >= 0) deepest = pick(deepest, ArgMax{static_cast<float>(depth[i]), i});
  deepest = block_reduce(deepest, sm.scratch_a, Pick());
  Walk w;
  w.final = deepest.idx;
  w.depth = depth[w.final];
  w.bonus = top[w.final];
  return w;
}

// Target-only rule: at each node test its children in id order; accept child x when
// u < p_res(x) / max(sum(p_res), p_res(x)); on rejection p_res(x) = 0. The final token
// is drawn from p_res (p itself at a leaf, or where p_res has no mass left).
template <typename T>
__device__ Walk walk_target_only(const SpecplugVerifyArgs& a, const Request& r, Smem& sm) {
  int* rej = sm.m.sampled.rej;
  Walk w;
  while (true) {
    const Row<T> p = row_of<T>(a.target, r, w.final, a.vocab);
    const double mass = mass_of<T>(a, r, w.final, sm);
    const float p_sum = static_cast<float>(mass);
    float rejected = 0.0f;        // float32, as the reference sums it
    double rejected_exact = 0.0;  // float64, for the no-mass-left guard
    int nrej = 0;
    int taken = -1;
    for (int c = next_child(sm, w.final, w.final + 1, r.n); c >= 0; c = next_child(sm, w.final, c + 1, r.n)) {
      const int x = sm.cand[c];
      float px = x >= 0 ? p.at(x) : 0.0f;
      if (in_list(rej, nrej, x)) px = 0.0f;  // a repeated token: already rejected
      const float ratio = px > 0.0f ? __fdiv_rn(px, fmaxf(__fsub_rn(p_sum, rejected), px)) : 0.0f;
      if (uniform(a, r.b, c) < ratio) {
        taken = c;
        break;
      }
      if (px > 0.0f) {
        __syncthreads();  // everyone has read rej
        if (threadIdx.x == 0) rej[nrej] = x;
        __syncthreads();
        nrej += 1;
        rejected = __fadd_rn(rejected, px);
        rejected_exact += static_cast<double>(px);
      }
    }
    if (taken < 0) {
      const int masked = mass - rejected_exact > 0.0 ? nrej : 0;
      w.bonus = sample_row<T, false>(p, p, uniform(a, r.b, 0), Plain(), rej, masked, sm);
      return w;
    }
    w.final = taken;
    w.depth += 1;
  }
}

// Draft-probability rule (Leviathan for chains, SpecInfer for trees): accept child c
// (token x) when u_c * q(x) < p_res(x), p_res = p / p_sum at first; on rejection
// p_res = norm(max(p_res - q, 0)). The final token is drawn from p_res.
template <typename T>
__device__ Walk walk_draft(const SpecplugVerifyArgs& a, const Request& r, Smem& sm) {
  float* norm = sm.m.sampled.norm;
  Walk w;
  while (true) {
    const Row<T> p = row_of<T>(a.target, r, w.final, a.vocab);
    const Row<T> q = row_of<T>(a.draft, r, w.final, a.vocab);
    const float p_sum = static_cast<float>(row_mass(p, 0, 1, sm));
    if (threadIdx.x == 0) norm[0] = p_sum;
    __syncthreads();
    int k = 0;
    int taken = -1;
    for (int c = next_child(sm, w.final, w.final + 1, r.n); c >= 0; c = next_child(sm, w.final, c + 1, r.n)) {
      const int x = sm.cand[c];
      const float qx = x >= 0 ? q.at(x) : 0.0f;
      const float rx = x >= 0 ? residual(p.at(x), qx, norm, k) : 0.0f;
      if (__fmul_rn(uniform(a, r.b, c), qx) < rx) {
        taken = c;
        break;
      }
      const float s = static_cast<float>(residual_mass(p, q, k, sm));
      if (threadIdx.x == 0) norm[k + 1] = s;
      __syncthreads();
      k += 1;
    }
    if (taken < 0) {
      w.bonus = sample_row<T, true>(p, q, uniform(a, r.b, 0), Residual{norm, k}, nullptr, 0, sm);
      return w;
    }
    w.final = taken;
    w.depth += 1;
  }
}

// ---------------------------------------------------------------------------------
// Depth of the deepest real node (root 0), for the result's width.
__device__ int tree_depth(Smem& sm, int n) {
  int deepest = 0;
  for (int i = threadIdx.x; i < n; i += kThreads) {
    int d = 0;
    for (int x = i; x > 0 && d < n; ++d) x = sm.par[x];
    deepest = max(deepest, d);
  }
  return block_reduce(deepest, sm.scratch_i, Max());
}

__device__ void write_result(const SpecplugVerifyArgs& a, int b, const Walk& w, int depth_of_tree, Smem& sm) {
  if (threadIdx.x == 0) {
    int x = w.final;
    for (int d = w.depth; d >= 0; --d) {
      sm.path[d] = x;
      x = x >= 0 ? sm.par[x] : -1;
    }
  }
  __syncthreads();
  int64_t* nodes = a.accepted_nodes + static_cast<int64_t>(b) * a.nodes;
  for (int i = threadIdx.x; i < a.nodes; i += kThreads) nodes[i] = i <= w.depth ? sm.path[i] : -1;
  if (threadIdx.x == 0) {
    a.num_accepted[b] = w.depth;
    a.bonus_token[b] = w.bonus;
    if (a.tree_depth) a.tree_depth[b] = depth_of_tree;
  }
}

// ROWS schedule, phase 1: reduce part `s` of row `j` into the workspace. Returns true
// in the block that finished its request last (which then walks the tree).
template <typename T, int kMethod>
__device__ bool reduce_part(const SpecplugVerifyArgs& a, const Request& r, int j, int s, Smem& sm) {
  const Row<T> p = row_of<T>(a.target, r, j, a.vocab);
  Partial out;
  if (kMethod == SPECPLUG_GREEDY) {
    out.best = row_argmax(p, s, a.splits, sm);
  } else {
    out.mass = row_mass(p, s, a.splits, sm);
  }
  int* counters = static_cast<int*>(a.workspace);
  if (threadIdx.x == 0) {
    partials(a, r.b, j)[s] = out;
    __threadfence();  // the partial is visible before the count says so
    const int done = atomicAdd(&counters[r.b], 1);
    sm.flag = done == r.n * a.splits - 1;
  }
  __syncthreads();
  if (!sm.flag) return false;
  __threadfence();
  if (threadIdx.x == 0) counters[r.b] = 0;  // ready for reuse
  return true;
}

template <typename T, int kMethod>
__global__ void __launch_bounds__(kThreads) verify_kernel(const SpecplugVerifyArgs a) {
  __shared__ Smem sm;
  const Request r = load_request(a, sm);
  const int j = blockIdx.y, s = blockIdx.x;
  if (r.n < 1) {  // no root row (bad num_nodes): nothing to verify
    if (j == 0 && s == 0) {
      Walk w;
      w.final = -1;
      write_result(a, r.b, w, 0, sm);
    }
    return;
  }
  if (a.mode == SPECPLUG_MODE_ROWS) {
    if (j >= r.n) return;
    if (!reduce_part<T, kMethod>(a, r, j, s, sm)) return;
  }
  for (int i = threadIdx.x; i < r.n; i += kThreads) {
    const int64_t at = static_cast<int64_t>(r.b) * a.nodes + i;
    const long long tok = a.candidates[at];
    const long long par = a.parents[at];
    sm.cand[i] = (tok >= 0 && tok < a.vocab) ? static_cast<int>(tok) : -1;
    sm.par[i] = (i > 0 && par >= 0 && par < i) ? static_cast<int>(par) : -1;
  }
  __syncthreads();
  Walk w;
  if (kMethod == SPECPLUG_GREEDY || kMethod == SPECPLUG_COUPLED) {
    w = walk_agreeing<T, kMethod>(a, r, sm);
  } else if (kMethod == SPECPLUG_TARGET_ONLY) {
    w = walk_target_only<T>(a, r, sm);
  } else {
    w = walk_draft<T>(a, r, sm);
  }
  const int depth_of_tree = tree_depth(sm, r.n);
  write_result(a, r.b, w, depth_of_tree, sm);
}

template <typename T>
cudaError_t launch_dtype(const SpecplugVerifyArgs& a, cudaStream_t stream) {
  const dim3 grid = a.mode == SPECPLUG_MODE_ROWS ? dim3(a.splits, a.nodes, a.batch) : dim3(1, 1, a.batch);
  switch (a.method) {
    case SPECPLUG_GREEDY:
      verify_kernel<T, SPECPLUG_GREEDY><<<grid, kThreads, 0, stream>>>(a);
      break;
    case SPECPLUG_COUPLED:
      verify_kernel<T, SPECPLUG_COUPLED><<<grid, kThreads, 0, stream>>>(a);
      break;
    case SPECPLUG_TARGET_ONLY:
      verify_kernel<T, SPECPLUG_TARGET_ONLY><<<grid, kThreads, 0, stream>>>(a);
      break;
    default:
      verify_kernel<T, SPECPLUG_DRAFT_REJECTION><<<grid, kThreads, 0, stream>>>(a);
      break;
  }
  return cudaGetLastError();
}

enum ArgError {
  kNullPointer = -1,
  kBadSize = -2,
  kBadEnum = -3,
  kNeedUniforms = -4,
  kNeedDraft = -5,
  kBadSplits = -6,
};

int check_args(const SpecplugVerifyArgs& a) {
  if (!a.target || !a.candidates || !a.parents || !a.accepted_nodes || !a.num_accepted || !a.bonus_token ||
      !a.workspace)
    return kNullPointer;
  if (a.batch < 1 || a.batch > 65535 || a.nodes < 1 || a.nodes > kMaxNodes || a.vocab < 1 || a.vocab > kMaxVocab)
    return kBadSize;
  if (a.dtype < SPECPLUG_F32 || a.dtype > SPECPLUG_F16 || a.method < SPECPLUG_GREEDY ||
      a.method > SPECPLUG_COUPLED || a.mode < SPECPLUG_MODE_ROWS || a.mode > SPECPLUG_MODE_PATH ||
      (a.method == SPECPLUG_COUPLED && a.mode != SPECPLUG_MODE_PATH))
    return kBadEnum;
  if (a.method != SPECPLUG_GREEDY && !a.uniforms) return kNeedUniforms;
  if (a.method == SPECPLUG_DRAFT_REJECTION && !a.draft) return kNeedDraft;
  if (a.mode == SPECPLUG_MODE_ROWS && (a.splits < 1 || a.splits > 65535)) return kBadSplits;
  return 0;
}

}  // namespace

extern "C" int64_t specplug_verify_workspace_bytes(int32_t batch, int32_t nodes, int32_t splits) {
  const int64_t counters = (static_cast<int64_t>(batch) * 4 + kCounterBytes - 1) / kCounterBytes * kCounterBytes;
  return counters + static_cast<int64_t>(batch) * nodes * (splits < 1 ? 1 : splits) * sizeof(Partial);
}

extern "C" int specplug_verify_launch(const SpecplugVerifyArgs* args, void* stream) {
  if (!args) return kNullPointer;
  SpecplugVerifyArgs a = *args;
  if (a.method == SPECPLUG_DRAFT_REJECTION) a.mode = SPECPLUG_MODE_PATH;  // no row phase
  const int bad = check_args(a);
  if (bad) return bad;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  if (a.mode == SPECPLUG_MODE_ROWS) {
    const cudaError_t err = cudaMemsetAsync(a.workspace, 0, static_cast<size_t>(a.batch) * 4, st);
    if (err != cudaSuccess) return err;
  }
  switch (a.dtype) {
    case SPECPLUG_F32:
      return launch_dtype<float>(a, st);
    case SPECPLUG_BF16:
      return launch_dtype<__nv_bfloat16>(a, st);
    default:
      return launch_dtype<__half>(a, st);
  }
}

extern "C" const char* specplug_verify_error_string(int code) {
  switch (code) {
    case 0:
      return "no error";
    case kNullPointer:
      return "a required pointer is NULL";
    case kBadSize:
      return "batch, nodes or vocab out of range (batch <= 65535, nodes <= 1024, vocab <= 262144)";
    case kBadEnum:
      return "unknown dtype, method or mode (or \"coupled\" outside the path mode)";
    case kNeedUniforms:
      return "stochastic verification needs uniforms";
    case kNeedDraft:
      return "draft rejection needs draft probabilities";
    case kBadSplits:
      return "splits must be in [1, 65535]";
    default:
      return cudaGetErrorString(static_cast<cudaError_t>(code));
  }
}
