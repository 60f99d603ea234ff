// Runs cuda_lstm.cu's forward or backward kernel on the CPU, its source compiled as it
// is with ptx_on_cpu.h's stand-ins for CUDA's built-ins and its PTX functions: one
// process per CTA (global memory is one shared mapping, a CTA's __shared__ its process's
// statics), one thread per CUDA thread. Slow; for small layers in tests.
//
//   run_on_cpu forward|backward T IN OUT
//     forward   IN: xw [T,B,4H], w_hh [4H,H], b_hh [4H] (fp32), h0 [B,H], c0 [B,H]
//              OUT: y [T,B,H], h_n [B,H], c_n [B,H], stash [T,B,5H] (fp32)
//     backward  IN: w_hh [4H,H], stash [T,B,5H] (fp32), c0 [B,H], dy [T,B,H], dh_n [B,H],
//                   dc_n [B,H]
//              OUT: dgates [T,B,4H], dh0 [B,H], dc0 [B,H]
// Files hold the tensors back to back, raw, in the layer's dtype (bf16 bits or fp32)
// unless marked fp32. Compile with cuda_lstm.cu's -D macros and
// -DLSTM_SOURCE='"path/to/cuda_lstm.cu"'.
#include <math.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
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

// Runs body() as every thread of every CTA: a process per CTA, THREADS threads in each.
template <typename Body>
bool run_grid(int ctas, Body body) {
  gridDim.x = ctas;
  std::vector<pid_t> children;
  for (int p = 0; p < ctas; ++p) {
    const pid_t pid = fork();
    if (pid < 0) return false;
    if (pid == 0) {
      blockIdx.x = p;
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

}  // namespace

int main(int argc, char** argv) {
  if (argc != 5) return fail("usage: run_on_cpu forward|backward T IN OUT");
  const std::string direction = argv[1];
  const int T = std::stoi(argv[2]);
  const bool forward = direction == "forward";
  if (!forward && direction != "backward") return fail("direction: forward or backward");
  const size_t e = sizeof(elem_t), f = sizeof(float), t = T;
  const std::vector<size_t> in = forward
      ? std::vector<size_t>{t * B * G * e, G * H * e, G * f, B * H * e, B * H * e}
      : std::vector<size_t>{G * H * e, t * B * STASH * f, B * H * e, t * B * H * e, B * H * e,
                            B * H * e};
  const std::vector<size_t> out = forward
      ? std::vector<size_t>{t * B * H * e, B * H * e, B * H * e, t * B * STASH * f}
      : std::vector<size_t>{t * B * G * e, B * H * e, B * H * e};

  // All tensors, the barrier's counter and the status flag in one shared mapping.
  std::vector<char*> at;
  size_t total = 0;
  for (size_t bytes : in) total += (bytes + 15) / 16 * 16;
  for (size_t bytes : out) total += (bytes + 15) / 16 * 16;
  char* memory = static_cast<char*>(mmap(nullptr, total + 16, PROT_READ | PROT_WRITE,
                                         MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  if (memory == MAP_FAILED) return fail("mmap failed");
  size_t offset = 0;
  for (size_t bytes : in) at.push_back(memory + offset), offset += (bytes + 15) / 16 * 16;
  for (size_t bytes : out) at.push_back(memory + offset), offset += (bytes + 15) / 16 * 16;
  auto* counter = reinterpret_cast<unsigned*>(memory + total);
  auto* status = reinterpret_cast<int*>(memory + total + 4);

  FILE* file = std::fopen(argv[3], "rb");
  if (!file) return fail(std::string("cannot open ") + argv[3]);
  for (size_t i = 0; i < in.size(); ++i)
    if (std::fread(at[i], 1, in[i], file) != in[i]) return fail("IN is shorter than its tensors");
  const bool longer = std::fgetc(file) != EOF;
  std::fclose(file);
  if (longer) return fail("IN is longer than its tensors");

  auto el = [&](size_t i) { return reinterpret_cast<elem_t*>(at[i]); };
  auto fp = [&](size_t i) { return reinterpret_cast<float*>(at[i]); };
  const int ctas = (H + UNITS - 1) / UNITS;
  const bool ran = forward
      ? run_grid(ctas, [&] {
          lstm_persistent_forward(el(0), el(1), fp(2), el(3), el(4), el(5), el(6), el(7), fp(8),
                                  counter, status, T);
        })
      : run_grid(ctas, [&] {
          lstm_persistent_backward(el(0), fp(1), el(2), el(3), el(4), el(5), el(6), el(7), el(8),
                                   counter, status, T);
        });
  if (!ran) return fail("a CTA's process failed");
  if (*status != 0) return fail("a grid barrier timed out");

  file = std::fopen(argv[4], "wb");
  if (!file) return fail(std::string("cannot open ") + argv[4]);
  for (size_t i = 0; i < out.size(); ++i) std::fwrite(at[in.size() + i], 1, out[i], file);
  return std::fclose(file) == 0 ? 0 : fail("cannot write OUT");
}
