// CUDA's built-ins and cuda_lstm.cu's PTX functions for a CPU run of its kernels
// (run_on_cpu.cpp): one process per CTA, one thread per CUDA thread, so that a
// function-scope __shared__ (here static) is one CTA's and a CTA's barrier is a
// std::barrier. The MMAs follow PTX's fragment layouts (which element of the tile each
// register of each lane holds), written from the PTX ISA, not from the kernel.
#pragma once

#include <barrier>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <sched.h>

#define LSTM_PTX_ON_CPU 1
#define __device__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(threads, blocks)
#define __shared__ static

struct Dim3 {
  unsigned x = 0, y = 0;
};
inline thread_local Dim3 threadIdx;
inline Dim3 blockIdx, gridDim;

constexpr int CPU_WARPS = 8;  // cuda_lstm.cu's WARPS

// Made in each CTA's process before its threads start.
inline std::unique_ptr<std::barrier<>> cta_barrier;
inline std::unique_ptr<std::barrier<>> warp_barriers[CPU_WARPS];

// A CTA's dynamic shared memory (the wavefront's W_ih, the forward's partial sums where
// LSTM_DYNAMIC_SUMS), allocated in its process.
inline void* dynamic_shared_memory = nullptr;

inline void __syncthreads() { cta_barrier->arrive_and_wait(); }
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline int atomicExch(int* p, int v) { return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST); }
inline float __uint_as_float(unsigned v) {
  float f;
  std::memcpy(&f, &v, 4);
  return f;
}
inline unsigned float_bits(float f) {
  unsigned v;
  std::memcpy(&v, &f, 4);
  return v;
}

// cvt.rn.bf16.f32: round to nearest, ties to even (finite inputs).
inline unsigned short to_bf16(float v) {
  const unsigned bits = float_bits(v);
  return static_cast<unsigned short>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

// cvt.rna.tf32.f32: 10 mantissa bits, round to nearest, ties away from zero.
inline unsigned to_tf32(float v) { return (float_bits(v) + 0x1000u) & 0xffffe000u; }

inline void load_l2_pair(const void* p, unsigned& lo, unsigned& hi) {
  const auto* words = static_cast<const unsigned*>(p);
  lo = __atomic_load_n(words, __ATOMIC_RELAXED);
  hi = __atomic_load_n(words + 1, __ATOMIC_RELAXED);
}

inline unsigned long long global_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

inline void arrive_release(unsigned* counter) {
  __atomic_fetch_add(counter, 1u, __ATOMIC_RELEASE);
}

inline unsigned load_acquire(const unsigned* counter) {
  sched_yield();  // other CTAs' threads share few cores
  return __atomic_load_n(counter, __ATOMIC_ACQUIRE);
}

// One operand word's elements as floats: two bf16 (lower half first) or one TF32.
inline void word_elements(unsigned word, float* out) {
#if LSTM_BF16
  out[0] = __uint_as_float(word << 16);
  out[1] = __uint_as_float(word & 0xffff0000u);
#else
  out[0] = __uint_as_float(word);
#endif
}

// mma.sync m16n8k16 (bf16) or m16n8k8 (tf32), fp32 accumulation: every lane of the warp
// posts its registers, each lane then computes its 4 C elements from the whole tiles.
// Lane l: group g = l/4, quad q = l%4; k counts operand words (2 bf16 or 1 tf32), 8 a
// row of A and a column of B.
// A (16 x K, row-major): register r holds row g + 8*(r%2), word q + 4*(r/2).
// B (K x 8): register r holds column g, word q + 4*r.
// C (16 x 8): register j holds row g + 8*(j/2), column 2q + j%2.
inline void mma(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  static unsigned posted_a[CPU_WARPS][32][4], posted_b[CPU_WARPS][32][2];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int r = 0; r < 4; ++r) posted_a[warp][lane][r] = a[r];
  posted_b[warp][lane][0] = b0;
  posted_b[warp][lane][1] = b1;
  warp_barriers[warp]->arrive_and_wait();

  constexpr int PER_WORD = LSTM_BF16 ? 2 : 1;
  constexpr int K = 8 * PER_WORD;
  float tile_a[16][K], tile_b[K][8];
  for (int l = 0; l < 32; ++l) {
    const int g = l / 4, q = l % 4;
    for (int r = 0; r < 4; ++r)
      word_elements(posted_a[warp][l][r], &tile_a[g + 8 * (r % 2)][(q + 4 * (r / 2)) * PER_WORD]);
    for (int r = 0; r < 2; ++r) {
      float e[2];
      word_elements(posted_b[warp][l][r], e);
      for (int i = 0; i < PER_WORD; ++i) tile_b[(q + 4 * r) * PER_WORD + i][g] = e[i];
    }
  }
  const int g = lane / 4, q = lane % 4;
  for (int j = 0; j < 4; ++j) {
    const int row = g + 8 * (j / 2), col = 2 * q + j % 2;
    double sum = d[j];
    for (int k = 0; k < K; ++k) sum += static_cast<double>(tile_a[row][k]) * tile_b[k][col];
    d[j] = static_cast<float>(sum);
  }
  warp_barriers[warp]->arrive_and_wait();  // no lane posts again before all have read
}
