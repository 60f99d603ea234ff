// Runs cuda_lstm.cu's forward or backward kernel on the CPU, its source compiled as it
// is with ptx_on_cpu.h's stand-ins for CUDA's built-ins and its PTX functions: one
// process per CTA (global memory is one shared mapping, a CTA's __shared__ its process's
// statics), one thread per CUDA thread; a grid of a layer's CTAs by its batch groups
// (blockIdx.y), each group's barrier counter apart. Slow; for small layers in tests.
//
//   run_on_cpu forward|backward T IN OUT   (B: the layer's batch, BATCH)
//     forward   IN: xw [T,B,4H], w_hh [4H,H], b_hh [4H] (fp32), h0 [B,H], c0 [B,H]
//              OUT: y [T,B,H], h_n [B,H], c_n [B,H], stash [T,B,5H]
//     backward  IN: w_hh [4H,H], stash [T,B,5H], c0 [B,H], dy [T,B,H], dh_n [B,H],
//                   dc_n [B,H]
//              OUT: dgates [T,B,4H], dh0 [B,H], dc0 [B,H]
//   run_on_cpu wavefront T IN OUT   (built with -DLSTM_LAYERS=L; mask: all zero = none)
//     IN: xw [T,B,4H], w_ih [L-1,4H,H], w_hh [L,4H,H], bias [L,4H] (fp32), h0 [L,B,H],
//         c0 [L,B,H], mask [L-1,T,B,H]
//    OUT: y [L,T,B,H], h_n [L,B,H], c_n [L,B,H], stash [L,T,B,5H]
// Files hold the tensors back to back, raw, in the layer's dtype (bf16 bits or fp32)
// unless marked fp32. Compile with cuda_lstm.cu's -D macros and
// -DLSTM_SOURCE='"path/to/cuda_lstm.cu"'.
#include <math.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "ptx_on_cpu.h"
#include LSTM_SOURCE

namespace {

int fail(const std::string& message) {
  std::fprintf(stderr, "run_on_cpu: %s\n", message.c_str());
  return 2;
}

// Runs body() as every thread of every CTA of a ctas x groups grid: a process per CTA,
// THREADS threads in each.
template <typename Body>
bool run_grid(int ctas, Body body, size_t dynamic_bytes = 0, int groups = 1) {
  gridDim.x = ctas;
  gridDim.y = groups;
  std::vector<pid_t> children;
  for (int p = 0; p < ctas * groups; ++p) {
    const pid_t pid = fork();
    if (pid < 0) return false;
    if (pid == 0) {
      blockIdx.x = p % ctas;
      blockIdx.y = p / ctas;
      dynamic_shared_memory = dynamic_bytes ? std::aligned_alloc(16, dynamic_bytes) : nullptr;
      cta_barrier = std::make_unique<std::barrier<>>(THREADS);
      for (auto& barrier : warp_barriers) barrier = std::make_unique<std::barrier<>>(32);
      std::vector<std::thread> threads;
      for (int i = 0; i < THREADS; ++i)
        threads.emplace_back([i, &body] {
          threadIdx.x = i;
          body();
        });
      for (auto& thread : threads) thread.join();
      _exit(0);
    }
    children.push_back(pid);
  }
  bool ok = true;
  for (pid_t pid : children) {
    int status = 0;
    ok = waitpid(pid, &status, 0) == pid && WIFEXITED(status) && WEXITSTATUS(status) == 0 && ok;
  }
  return ok;
}

// All tensors (IN's, then OUT's), the barrier counters (a batch group's every
// COUNTER_STRIDE words) and the status flag in one shared mapping.
struct Memory {
  std::vector<char*> at;
  unsigned* counter = nullptr;
  int* status = nullptr;

  bool make(const std::vector<size_t>& in, const std::vector<size_t>& out) {
    size_t total = 0;
    for (size_t bytes : in) total += (bytes + 15) / 16 * 16;
    for (size_t bytes : out) total += (bytes + 15) / 16 * 16;
    const size_t counters = sizeof(unsigned) * GROUPS * COUNTER_STRIDE;
    char* base = static_cast<char*>(mmap(nullptr, total + counters + 16, PROT_READ | PROT_WRITE,
                                         MAP_SHARED | MAP_ANONYMOUS, -1, 0));
    if (base == MAP_FAILED) return false;
    size_t offset = 0;
    for (size_t bytes : in) at.push_back(base + offset), offset += (bytes + 15) / 16 * 16;
    for (size_t bytes : out) at.push_back(base + offset), offset += (bytes + 15) / 16 * 16;
    counter = reinterpret_cast<unsigned*>(base + total);
    status = reinterpret_cast<int*>(base + total + counters);
    return true;
  }

  // IN's tensors from the file, which must hold exactly them.
  bool read(const char* path, const std::vector<size_t>& in) {
    FILE* file = std::fopen(path, "rb");
    if (!file) return false;
    bool ok = true;
    for (size_t i = 0; i < in.size(); ++i) ok = ok && std::fread(at[i], 1, in[i], file) == in[i];
    ok = ok && std::fgetc(file) == EOF;
    std::fclose(file);
    return ok;
  }

  // OUT's first out.size() tensors (at[first], ...) to the file.
  bool write(const char* path, size_t first, const std::vector<size_t>& out) {
    FILE* file = std::fopen(path, "wb");
    if (!file) return false;
    for (size_t i = 0; i < out.size(); ++i) std::fwrite(at[first + i], 1, out[i], file);
    return std::fclose(file) == 0;
  }
};

}  // namespace

#ifdef LSTM_LAYERS
int main(int argc, char** argv) {
  if (argc != 5 || std::string(argv[1]) != "wavefront")
    return fail("usage: run_on_cpu wavefront T IN OUT (built with LSTM_LAYERS)");
  const int T = std::stoi(argv[2]);
  const size_t e = sizeof(elem_t), f = sizeof(float), t = T, L = LAYERS;
  const std::vector<size_t> in{t * B * G * e,     (L - 1) * G * H * e, L * G * H * e,
                               L * G * f,         L * B * H * e,       L * B * H * e,
                               (L - 1) * t * B * H * e};
  const std::vector<size_t> out{L * t * B * H * e, L * B * H * e, L * B * H * e,
                                L * t * B * STASH * e, (L - 1) * t * B * H * e};
  Memory memory;
  if (!memory.make(in, out)) return fail("mmap failed");
  if (!memory.read(argv[3], in)) return fail("IN is not its tensors' size");
  bool masked = false;
  for (size_t i = 0; i < in[6]; ++i) masked = masked || memory.at[6][i] != 0;
  auto el = [&](size_t i) { return reinterpret_cast<elem_t*>(memory.at[i]); };
  auto fp = [&](size_t i) { return reinterpret_cast<float*>(memory.at[i]); };
  LayerWeights weights;
  LayerOutputs outputs;
  for (int l = 0; l < LAYERS; ++l) {
    weights.w_ih[l] = l == 0 ? nullptr : el(1) + (l - 1) * G * H;
    weights.w_hh[l] = el(2) + l * G * H;
    outputs.y[l] = el(7) + l * t * B * H;
    outputs.stash[l] = el(10) + l * t * B * STASH;
  }
  const bool ran = run_grid(
      LAYERS * CTAS_PER_LAYER,
      [&] {
        lstm_wavefront_forward(el(0), weights, fp(3), el(4), el(5), masked ? el(6) : nullptr,
                               masked ? el(11) : nullptr, outputs, el(8), el(9), memory.counter,
                               memory.status, T);
      },
      sizeof(FragmentWords) * W_IH_TILES * THREADS);
  if (!ran) return fail("a CTA's process failed");
  if (*memory.status != 0) return fail("a grid barrier timed out");
  // the dropped copies are the kernel's scratch: not written out
  return memory.write(argv[4], in.size(), {out.begin(), out.end() - 1}) ? 0
                                                                        : fail("cannot write OUT");
}
#else
int main(int argc, char** argv) {
  if (argc != 5) return fail("usage: run_on_cpu forward|backward T IN OUT");
  const std::string direction = argv[1];
  const int T = std::stoi(argv[2]);
  const bool forward = direction == "forward";
  if (!forward && direction != "backward") return fail("direction: forward or backward");
  const size_t e = sizeof(elem_t), f = sizeof(float), t = T;
  constexpr size_t B = BATCH;  // the tensors' rows (a group's: cuda_lstm.cu's B)
  const std::vector<size_t> in = forward
      ? std::vector<size_t>{t * B * G * e, G * H * e, G * f, B * H * e, B * H * e}
      : std::vector<size_t>{G * H * e, t * B * STASH * e, B * H * e, t * B * H * e, B * H * e,
                            B * H * e};
  const std::vector<size_t> out = forward
      ? std::vector<size_t>{t * B * H * e, B * H * e, B * H * e, t * B * STASH * e}
      : std::vector<size_t>{t * B * G * e, B * H * e, B * H * e};

  Memory memory;
  if (!memory.make(in, out)) return fail("mmap failed");
  if (!memory.read(argv[3], in)) return fail("IN is not its tensors' size");
  auto* counter = memory.counter;
  auto* status = memory.status;
  auto el = [&](size_t i) { return reinterpret_cast<elem_t*>(memory.at[i]); };
  auto fp = [&](size_t i) { return reinterpret_cast<float*>(memory.at[i]); };
  const int ctas = (H + UNITS - 1) / UNITS;
  const size_t sums = LSTM_DYNAMIC_SUMS ? sizeof(float) * WARPS * ROWS * COLS : 0;
  const bool ran = forward
      ? run_grid(
            ctas,
            [&] {
              lstm_persistent_forward(el(0), el(1), fp(2), el(3), el(4), el(5), el(6), el(7),
                                      el(8), counter, status, T);
            },
            sums, GROUPS)
      : run_grid(
            ctas,
            [&] {
              lstm_persistent_backward(el(0), el(1), el(2), el(3), el(4), el(5), el(6), el(7),
                                       el(8), counter, status, T);
            },
            0, GROUPS);
  if (!ran) return fail("a CTA's process failed");
  if (*status != 0) return fail("a grid barrier timed out");

  return memory.write(argv[4], in.size(), out) ? 0 : fail("cannot write OUT");
}
#endif
