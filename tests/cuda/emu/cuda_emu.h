// Test support, not product code: runs specplug's CUDA kernels on the CPU so that their
// logic can be tested on machines without a GPU. Every CUDA thread of a block is a
// cooperative coroutine (ucontext) on one OS thread; __syncthreads, warp shuffles and
// ballots are real barriers among the block's / warp's coroutines; blocks run one after
// another. Shared memory = function-local statics. Models CUDA's semantics for the
// subset of the language verify_kernels.cu uses, not its timing or memory model.
#pragma once
#include <ucontext.h>

#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static

struct dim3 {
  unsigned x, y, z;
  dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
struct EmuIndex {
  unsigned x, y, z;
};
inline EmuIndex threadIdx, blockIdx;
inline dim3 blockDim, gridDim;

struct uint4 {
  unsigned x, y, z, w;
};
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return uint4{a, b, c, d}; }

struct __nv_bfloat16 {
  uint16_t bits;
};
struct __half {
  uint16_t bits;
};
inline float __bfloat162float(__nv_bfloat16 h) {
  uint32_t u = static_cast<uint32_t>(h.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float __half2float(__half h) {
  const uint32_t sign = (h.bits >> 15) & 1u, exp = (h.bits >> 10) & 31u, man = h.bits & 1023u;
  float mag;
  if (exp == 0) mag = std::ldexp(static_cast<float>(man), -24);
  else if (exp == 31) mag = man ? NAN : INFINITY;
  else mag = std::ldexp(static_cast<float>(man | 1024u), static_cast<int>(exp) - 25);
  return sign ? -mag : mag;
}

struct CUstream_st;
typedef CUstream_st* cudaStream_t;
enum cudaError_t { cudaSuccess = 0 };
inline cudaError_t cudaMemsetAsync(void* p, int v, size_t n, cudaStream_t) {
  std::memset(p, v, n);
  return cudaSuccess;
}
inline cudaError_t cudaGetLastError() { return cudaSuccess; }
inline const char* cudaGetErrorString(cudaError_t) { return "cuda error (emulated)"; }

template <typename T>
inline T __ldg(const T* p) { return *p; }
template <typename T>
inline T __ldcg(const T* p) { return *p; }
inline void __threadfence() {}
inline int atomicAdd(int* p, int v) {
  const int old = *p;
  *p += v;
  return old;
}
inline int __ffs(unsigned x) { return __builtin_ffs(static_cast<int>(x)); }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
using std::isnan;

namespace emu {

struct Barrier {
  int expected = 0;
  int arrived = 0;
  long generation = 0;
};

struct Thread {
  ucontext_t context;
  std::vector<char> stack;
  bool done = false;
};

inline std::vector<Thread> threads;
inline std::vector<Barrier> warp_barriers;
inline Barrier block_barrier;
inline std::vector<uint64_t> exchange;  // one slot per thread, for shuffles and ballots
inline ucontext_t scheduler;
inline int current = 0;
inline std::function<void()> body;
inline long long releases = 0;

inline void yield() { swapcontext(&threads[current].context, &scheduler); }

inline void wait(Barrier& b) {
  const long gen = b.generation;
  if (++b.arrived == b.expected) {
    b.arrived = 0;
    b.generation += 1;
    releases += 1;
    return;
  }
  while (b.generation == gen) yield();
}

inline void trampoline() {
  body();
  threads[current].done = true;
}

// Runs `kernel` for every block of `grid` with `count` threads each.
inline void launch(dim3 grid, int count, std::function<void()> kernel) {
  if (count % 32) {
    std::fprintf(stderr, "emu: block size must be a multiple of 32\n");
    std::abort();
  }
  body = std::move(kernel);
  blockDim = dim3(count);
  gridDim = grid;
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        blockIdx = EmuIndex{x, y, z};
        threads.assign(count, Thread{});
        exchange.assign(count, 0);
        warp_barriers.assign(count / 32, Barrier{});
        for (auto& w : warp_barriers) w.expected = 32;
        block_barrier = Barrier{};
        block_barrier.expected = count;
        for (int t = 0; t < count; ++t) {
          Thread& th = threads[t];
          th.stack.resize(1 << 16);
          getcontext(&th.context);
          th.context.uc_stack.ss_sp = th.stack.data();
          th.context.uc_stack.ss_size = th.stack.size();
          th.context.uc_link = &scheduler;
          makecontext(&th.context, trampoline, 0);
        }
        int alive = count;
        long long idle_rounds = 0;
        while (alive > 0) {
          const long long before = releases;
          int finished = 0;
          for (int t = 0; t < count; ++t) {
            if (threads[t].done) continue;
            current = t;
            threadIdx = EmuIndex{static_cast<unsigned>(t), 0, 0};
            swapcontext(&scheduler, &threads[t].context);
            if (threads[t].done) finished += 1;
          }
          alive -= finished;
          idle_rounds = (finished == 0 && releases == before) ? idle_rounds + 1 : 0;
          if (idle_rounds > 3) {  // every live thread waits on a barrier that cannot complete
            std::fprintf(stderr, "emu: deadlock in block (%u,%u,%u): %d threads stuck at a barrier\n", x, y, z,
                         alive);
            std::abort();
          }
        }
        // A thread that returned while others still wait at __syncthreads would deadlock
        // above; one that returned while its warp shuffles would too.
      }
}

template <typename V>
inline uint64_t bits_of(V v) {
  uint64_t u = 0;
  std::memcpy(&u, &v, sizeof(V));
  return u;
}
template <typename V>
inline V from_bits(uint64_t u) {
  V v;
  std::memcpy(&v, &u, sizeof(V));
  return v;
}

template <typename V>
inline V shuffle(V v, int src_lane_or_minus1) {
  const int me = static_cast<int>(threadIdx.x), warp = me >> 5;
  exchange[me] = bits_of(v);
  wait(warp_barriers[warp]);
  const V got = src_lane_or_minus1 < 0 ? v : from_bits<V>(exchange[warp * 32 + src_lane_or_minus1]);
  wait(warp_barriers[warp]);
  return got;
}

}  // namespace emu

inline void __syncthreads() { emu::wait(emu::block_barrier); }

template <typename V>
inline V __shfl_xor_sync(unsigned, V v, int mask) {
  return emu::shuffle(v, static_cast<int>(threadIdx.x & 31) ^ mask);
}
template <typename V>
inline V __shfl_up_sync(unsigned, V v, int delta) {
  const int src = static_cast<int>(threadIdx.x & 31) - delta;
  return emu::shuffle(v, src >= 0 ? src : -1);
}
template <typename V>
inline V __shfl_sync(unsigned, V v, int lane) {
  return emu::shuffle(v, lane & 31);
}
inline unsigned __ballot_sync(unsigned, bool pred) {
  const int me = static_cast<int>(threadIdx.x), warp = me >> 5;
  emu::exchange[me] = pred ? 1u : 0u;
  emu::wait(emu::warp_barriers[warp]);
  unsigned m = 0;
  for (int l = 0; l < 32; ++l)
    if (emu::exchange[warp * 32 + l]) m |= 1u << l;
  emu::wait(emu::warp_barriers[warp]);
  return m;
}
