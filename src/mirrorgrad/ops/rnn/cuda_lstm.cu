// One LSTM layer's recurrence, all T steps in one persistent launch: forward and backward;
// and (with LSTM_LAYERS) a stack of layers' forward in one launch as a wavefront (at the
// end of this file).
//
// Forward. The input side xW_t = x_t W_ih^T + b_ih of every step is one cuBLAS GEMM
// before the launch; the kernel computes, for t = 0..T-1,
//     gates_t = xW_t + h_{t-1} W_hh^T + b_hh          (gate order i, f, g, o: torch.nn.LSTM)
//     c_t = sigmoid(f) c_{t-1} + sigmoid(i) tanh(g),   h_t = sigmoid(o) tanh(c_t)
// and writes y[t] = h_t, h_n = h_{T-1}, c_n = c_{T-1}, and where asked the stash the
// backward reads: the gates' pre-activations and c_t of every step, in the layer's dtype.
// Pre-activations, not the activated gates: in bf16 a saturated gate (f = 0.998) rounds
// to 1 and its derivative f(1-f) to 0: that doubled the bf16 weight gradients' error
// against float64 (docs/rnn-op.md). The backward applies the activations again: the
// forward's functions, in fp32 layers on the very values the forward activated.
//
// Backward. From the stash (its gates activated), dy (the gradient of each y[t]) and
// dh_n, dc_n it computes, for t = T-1..0, with dh_t = dy_t + dgates_{t+1} W_hh (+ dh_n
// at t = T-1):
//     dc = dc_t + dh_t o (1 - tanh^2 c_t)
//     dgates_t = (dc g i(1-i), dc c_{t-1} f(1-f), dc i (1-g^2), dh_t tanh(c_t) o(1-o))
//     dc_{t-1} = dc f
// writes dgates_t for every t (dW_hh, dW_ih, dx and the biases are one GEMM each after the
// launch), and dh0 = dgates_0 W_hh, dc0 = dc_{-1}.
//
// Layout (as the persistent RNNs of Diamos et al. 2016): CTA p owns UNITS hidden units
// [p*UNITS, (p+1)*UNITS) and all four gates of them, so the cell needs no other CTA's
// result. Forward: its 4*UNITS rows of W_hh are loaded once into registers as tensor-core
// MMA A fragments (bf16: mma m16n8k16; fp32: mma m16n8k8 in TF32) and stay there for all
// T steps: nothing re-reads W_hh from shared memory or L2. The 8 warps split K (the
// hidden input); each step a warp reads h_{t-1} (B x H, from L2) as B fragments, the
// warps' partial sums meet in shared memory, one thread per (unit, batch row) applies
// the cell (c stays in its registers, fp32), writes its h_t, and the grid synchronises
// once per step. Backward: the same units, and their UNITS columns of W_hh (rows of
// W_hh^T, K = the 4H gate rows) in registers as MMA B fragments (units are the MMA's N);
// each step a warp reads its K slice of dgates_{t+1} (B x 4H, from L2) as A fragments
// (batch rows are the MMA's M), the partial sums meet in shared memory, one thread per
// (unit, batch row) runs the cell backward (dc in its registers, fp32), writes its
// dgates_t, and the grid synchronises once per step. The launch is cooperative, so every
// CTA is resident and the spin barrier cannot wait on a CTA that never runs; it also
// gives up after BARRIER_TIMEOUT_NS (status = 1) so that no mistake can hang the GPU.
//
// Batch groups. A batch past what one CTA's registers take (GROUP_BATCH rows) is split
// into groups of rows, blockIdx.y the group: each group is the layout above for its rows
// (its CTAs hold their own copy of their units' W), with its own barrier counter, since
// batch rows never interact and the groups never wait on each other. The tensors keep
// their [T, BATCH, ...] layout: a CTA moves their base pointers to its group's first row,
// so row b of the group is row b everywhere below, steps BATCH rows apart. The last group
// may have fewer rows (group_rows).
//
// Compile-time configuration (-D from cuda_lstm_kernel.py):
//   LSTM_BF16    1: bf16 tensors; 0: fp32 tensors (TF32 products, fp32 accumulation)
//   LSTM_HIDDEN  H (a multiple of 8)
//   LSTM_BATCH   BATCH, the layer's batch
//   LSTM_GROUP_BATCH  B, the batch rows of a group (default BATCH: one group); the launch
//                has ceil(BATCH / B) groups (gridDim.y)
//   LSTM_DYNAMIC_SUMS  1: the forward's partial sums in dynamic shared memory (past the
//                48 KiB a CTA's static shared memory may take), WARPS*ROWS*COLS floats;
//                0 (default): static
//   LSTM_FORWARD_BY_N_TILE  1: the forward's MMAs and sums one batch tile (n tile) at a
//                time, so that its accumulators take M_TILES*4 registers, not
//                M_TILES*N_TILES*4; default 1 where those would pass 64 (a batch group of
//                20 units at 32 rows: W's 120 registers beside 80 accumulators spilled)
//   LSTM_UNITS   hidden units per CTA (a multiple of 4, so 4*UNITS rows fill 16-row tiles)
//   LSTM_LEAVE_OUT  timing variants (wrong results): 1 leaves out the grid barrier, 2 the
//                recurrent product (the h_{t-1} or dgates_{t+1} reads and MMAs); 0
//                (default) the layer
//   LSTM_LAYERS  where defined (2 or more): the wavefront forward of a stack of that many
//                layers, in place of the single layer's two kernels
//   LSTM_BARRIER_FENCES  1 (default): the barrier's thread 0 also runs __threadfence()
//                before arriving and after its wait, as cooperative groups' grid sync
//                does; 0: release arrival and acquire polling alone (the release/acquire
//                pattern of the PTX memory model; measured beside the default, not
//                assumed)
// No header is included: the source compiles with NVRTC alone.

#if !defined(LSTM_BF16) || !defined(LSTM_HIDDEN) || !defined(LSTM_BATCH) || !defined(LSTM_UNITS)
#error "define LSTM_BF16, LSTM_HIDDEN, LSTM_BATCH and LSTM_UNITS"
#endif
#ifndef LSTM_LEAVE_OUT
#define LSTM_LEAVE_OUT 0
#endif
#ifndef LSTM_BARRIER_FENCES
#define LSTM_BARRIER_FENCES 1
#endif
#ifndef LSTM_GROUP_BATCH
#define LSTM_GROUP_BATCH LSTM_BATCH
#endif
#ifndef LSTM_DYNAMIC_SUMS
#define LSTM_DYNAMIC_SUMS 0
#endif
#ifndef LSTM_FORWARD_BY_N_TILE  // M_TILES * N_TILES * 4 > 64
#define LSTM_FORWARD_BY_N_TILE (LSTM_UNITS / 4 * ((LSTM_GROUP_BATCH + 7) / 8) * 4 > 64)
#endif

constexpr int H = LSTM_HIDDEN;
constexpr int BATCH = LSTM_BATCH;     // rows of the tensors: a step is BATCH rows
constexpr int B = LSTM_GROUP_BATCH;   // rows of a batch group: its MMA tiles and cells
constexpr int GROUPS = (BATCH + B - 1) / B;
// A group's barrier counter is a 128-byte line of its own: the groups' arrivals do not
// contend for one line.
constexpr int COUNTER_STRIDE = 32;
constexpr int UNITS = LSTM_UNITS;
constexpr int WARPS = 8;
constexpr int THREADS = WARPS * 32;
constexpr int ROWS = 4 * UNITS;       // W_hh rows of this CTA: local row r = gate r/UNITS
constexpr int M_TILES = ROWS / 16;    // of unit r%UNITS
constexpr int N_TILES = (B + 7) / 8;  // batch rows are the MMA's N (8 a tile)
constexpr int COLS = N_TILES * 8;
#if LSTM_BF16
typedef unsigned short elem_t;  // bf16 bits
constexpr int K_STEP = 16;
#else
typedef float elem_t;
constexpr int K_STEP = 8;
#endif
// K inside a k-step: an MMA sums over its K_STEP k's in any order, so the kernels choose
// which elements each lane's registers hold. PTX has lane quad q's two words of a row
// (A: a0 and a2, or a1 and a3; B: b0 and b1) at logical k offsets q and q + 4 (in
// words); here they are the adjacent words 2q and 2q + 1, one 8-byte load, and a row's
// four lanes read one 32-byte sector. A and B take the same order, so the sum is the
// product's.
constexpr int PER_WORD = LSTM_BF16 ? 2 : 1;  // elements in a 32-bit operand word
constexpr int K_STEPS = (H + K_STEP - 1) / K_STEP;
constexpr int K_PER_WARP = (K_STEPS + WARPS - 1) / WARPS;  // warp w takes k-steps w, w+8, ...
constexpr int CELLS = UNITS * B;                          // (unit, batch row) pairs
constexpr int CELLS_PER_THREAD = (CELLS + THREADS - 1) / THREADS;
// Backward's product dgates_{t+1} W_hh[:, units]: batch rows are the MMA's M (16 a tile),
// this CTA's units its N (8 a tile), the G = 4H gate rows its K (a multiple of 32).
constexpr int G = 4 * H;
constexpr int BWD_M_TILES = (B + 15) / 16;
constexpr int BWD_N_TILES = (UNITS + 7) / 8;
constexpr int BWD_K_STEPS = G / K_STEP;
constexpr int BWD_K_PER_WARP = (BWD_K_STEPS + WARPS - 1) / WARPS;
// With one tile a warp's MMAs would be one chain of up to 64 dependent ones: its k-steps
// feed 4 accumulators in turn. Two or more tiles are independent chains already, and
// more accumulators take registers the batch-20 loads need (ptxas spilled at bf16
// H = 1024 with 2 a tile).
constexpr int BWD_CHAINS_WANTED = BWD_M_TILES * BWD_N_TILES == 1 ? 4 : 1;
constexpr int BWD_CHAINS = BWD_K_PER_WARP < BWD_CHAINS_WANTED ? BWD_K_PER_WARP : BWD_CHAINS_WANTED;
// A stash row of a (step, batch row): the pre-activations of i, f, g, o, then c_t.
constexpr int STASH = 5 * H;
constexpr unsigned long long BARRIER_TIMEOUT_NS = 1000000000ull;

static_assert(H % 8 == 0, "H must be a multiple of 8 (aligned 32-bit fragment loads)");
static_assert(UNITS % 4 == 0, "UNITS must be a multiple of 4");
static_assert(1 <= B && B <= BATCH, "a batch group has 1 to BATCH rows");
// A CTA's static shared memory: 48 KiB for the partial sums and the grid barrier's flag.
constexpr int SHARED_FOR_SUMS = 48 * 1024 - static_cast<int>(sizeof(int));
#if LSTM_DYNAMIC_SUMS
static_assert(sizeof(float) * WARPS * ROWS * COLS + sizeof(int) <= 227 * 1024,
              "partial sums exceed the shared memory a CTA may opt in to (sm_90)");
#else
static_assert(sizeof(float) * WARPS * ROWS * COLS <= SHARED_FOR_SUMS,
              "partial sums and the barrier's flag exceed 48 KiB");
#endif
static_assert(sizeof(float) * WARPS * BWD_M_TILES * 16 * BWD_N_TILES * 8 <= SHARED_FOR_SUMS,
              "backward partial sums and the barrier's flag exceed 48 KiB");

// PTX, one instruction a function: the rest of this file is plain CUDA C++.
// tests/benchmarks_persistent_cuda/ptx_on_cpu.h defines the same functions (and CUDA's
// built-ins) for a CPU run of these kernels, with LSTM_PTX_ON_CPU set.
#ifndef LSTM_PTX_ON_CPU
__device__ __forceinline__ unsigned short to_bf16(float v) {  // round to nearest even
  unsigned short bits;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(bits) : "f"(v));
  return bits;
}

__device__ __forceinline__ unsigned to_tf32(float v) {  // fp32 bits, 13 low bits zero
  unsigned r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(v));
  return r;
}

// Two 32-bit words (8 bytes) loaded at L2 (.cg): other SMs' stores of this launch are
// seen there, not in this SM's L1.
__device__ __forceinline__ void load_l2_pair(const void* p, unsigned& lo, unsigned& hi) {
  asm volatile("ld.global.cg.v2.b32 {%0, %1}, [%2];" : "=r"(lo), "=r"(hi) : "l"(p) : "memory");
}

__device__ __forceinline__ void mma(float (&d)[4], const unsigned (&a)[4], unsigned b0,
                                    unsigned b1) {
#if LSTM_BF16
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ void arrive_release(unsigned* counter) {
  asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(counter) : "memory");
}

__device__ __forceinline__ unsigned load_acquire(const unsigned* counter) {
  unsigned seen;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(counter) : "memory");
  return seen;
}
#endif

__device__ __forceinline__ float to_float(unsigned short bits) {
  return __uint_as_float(static_cast<unsigned>(bits) << 16);
}
__device__ __forceinline__ float to_float(float v) { return v; }

__device__ __forceinline__ void store(unsigned short* p, float v) { *p = to_bf16(v); }
__device__ __forceinline__ void store(float* p, float v) { *p = v; }

// One 32-bit MMA operand word at (row, k) of a row-major matrix with H columns: two
// bf16 (k, k+1), or one fp32 rounded to TF32; zero beyond the matrix (padding of K).
__device__ __forceinline__ unsigned operand_word(const elem_t* row, int k) {
  if (k >= H) return 0u;
#if LSTM_BF16
  return *reinterpret_cast<const unsigned*>(row + k);
#else
  return to_tf32(row[k]);
#endif
}

// A lane's two operand words of a row at p (adjacent: see PER_WORD) of a matrix that
// other CTAs wrote during this launch (h_{t-1}, dgates_{t+1}), loaded at L2, or zeros
// where they are padding (!inside). Callers address it as a lane's base plus a
// constant, so that the loads need no address arithmetic.
__device__ __forceinline__ void fresh_pair(const elem_t* p, bool inside, unsigned& w0,
                                           unsigned& w1) {
  w0 = w1 = 0u;
  if (!inside) return;
  load_l2_pair(p, w0, w1);
#if !LSTM_BF16
  w0 = to_tf32(__uint_as_float(w0));
  w1 = to_tf32(__uint_as_float(w1));
#endif
}

// One 32-bit B operand word of W_hh^T at (gate row k, unit): W_hh[k][unit] and
// W_hh[k+1][unit] as two bf16 (the lower k in the lower half), or W_hh[k][unit] in TF32.
__device__ __forceinline__ unsigned column_word(const elem_t* w_hh, int k, int unit) {
#if LSTM_BF16
  const unsigned lo = w_hh[static_cast<long long>(k) * H + unit];
  const unsigned hi = w_hh[static_cast<long long>(k + 1) * H + unit];
  return lo | (hi << 16);
#else
  return to_tf32(w_hh[static_cast<long long>(k) * H + unit]);
#endif
}

// Whether k-step kk of a warp's (warp + kk*WARPS) is one of the layer's: where WARPS
// divides the k-steps, every kk < K_PER_WARP is (known at compile time).
__device__ __forceinline__ bool forward_k_step(int warp, int kk) {
  return kk < K_PER_WARP && (K_STEPS % WARPS == 0 || warp + kk * WARPS < K_STEPS);
}
__device__ __forceinline__ bool backward_k_step(int warp, int kk) {
  return kk < BWD_K_PER_WARP && (BWD_K_STEPS % WARPS == 0 || warp + kk * WARPS < BWD_K_STEPS);
}

// The batch rows of this CTA's group: B, but for a last group BATCH does not fill.
__device__ __forceinline__ int group_rows() {
  if (BATCH % B == 0) return B;
  const int left = BATCH - static_cast<int>(blockIdx.y) * B;
  return left < B ? left : B;
}

// Where this CTA's group's rows start in a [..., BATCH, width] tensor (zero for one group).
__device__ __forceinline__ long long group_offset(int width) {
  return GROUPS == 1 ? 0 : static_cast<long long>(blockIdx.y) * B * width;
}

// The cells this thread updates: cell = threadIdx.x + i*THREADS is (unit, batch row)
// (cell % UNITS, cell / UNITS); false where it is past the layer or the group's rows.
__device__ __forceinline__ bool my_cell(int i, int unit0, int& unit, int& b) {
  const int cell = threadIdx.x + i * THREADS;
  unit = unit0 + cell % UNITS;
  b = cell / UNITS;
  // (with full groups, cell < CELLS keeps b below B already)
  return cell < CELLS && unit < H && (BATCH % B == 0 || b < group_rows());
}

// Step t's input side of this thread's cells: it does not depend on h_{t-1}, so it is
// loaded a step ahead, before the barrier wait.
__device__ __forceinline__ void load_x_side(float (&x_side)[CELLS_PER_THREAD][4],
                                            const elem_t* xw, int t, int unit0) {
#pragma unroll
  for (int i = 0; i < CELLS_PER_THREAD; ++i) {
    int unit, b;
    const bool mine = my_cell(i, unit0, unit, b);
    const elem_t* at = xw + (static_cast<long long>(t) * BATCH + b) * 4 * H + unit;
#pragma unroll
    for (int q = 0; q < 4; ++q) x_side[i][q] = mine ? to_float(at[q * H]) : 0.0f;
  }
}

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// The MMA fragments' coordinates of this thread: its warp, the fragments' row (A, C) or
// column (B) in the tile (group), and the lane's first k in a k-step (PER_WORD).
__device__ __forceinline__ int warp_index() { return threadIdx.x / 32; }
__device__ __forceinline__ int lane_group() { return threadIdx.x % 32 / 4; }
__device__ __forceinline__ int lane_k() { return 2 * PER_WORD * (threadIdx.x % 4); }

// This warp's slice of the CTA's 4*UNITS rows of a [4H, H] weight (W_hh, or a wavefront
// layer's W_ih) as A fragments: rows mt*16 + {group, group+8} (local row r is gate r/UNITS
// of unit unit0 + r%UNITS), k-step warp + kk*WARPS, words at ka (a0, a1) and ka + PER_WORD
// (a2, a3); zero past H.
__device__ __forceinline__ void load_row_fragments(unsigned (&frag)[M_TILES][K_PER_WARP][4],
                                                   const elem_t* w, int unit0) {
  const int warp = warp_index(), group = lane_group(), k_lane = lane_k();
#pragma unroll
  for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = mt * 16 + group + 8 * half;
      const int unit = unit0 + r % UNITS;
      const elem_t* row = w + static_cast<long long>((r / UNITS) * H + unit) * H;
#pragma unroll
      for (int kk = 0; kk < K_PER_WARP; ++kk) {
        const int step = warp + kk * WARPS;
        const int ka = step * K_STEP + k_lane;
        const bool inside = unit < H && step < K_STEPS;
        frag[mt][kk][half] = inside ? operand_word(row, ka) : 0u;
        frag[mt][kk][2 + half] = inside ? operand_word(row, ka + PER_WORD) : 0u;
      }
    }
  }
}

__device__ __forceinline__ void zero(float (&acc)[M_TILES][N_TILES][4]) {
#pragma unroll
  for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
    for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[mt][nt][j] = 0.0f;
}

// A step's B x H input of the product (h_{t-1}, or a wavefront layer's input), written by
// other CTAs of this launch, as B fragments (column n = batch row, words at ka and
// ka + PER_WORD): all of the step's loads before its MMAs, since a warp issues in order
// (a load after an MMA that waits for an earlier load would wait too: an L2 round trip
// per k-step).
__device__ __forceinline__ void load_step_fragments(unsigned (&frag)[K_PER_WARP][N_TILES][2],
                                                    const elem_t* src) {
  const int warp = warp_index(), group = lane_group(), k_lane = lane_k(), rows = group_rows();
  const elem_t* lane_src = src + group * H + warp * K_STEP + k_lane;
#pragma unroll
  for (int kk = 0; kk < K_PER_WARP; ++kk) {
    const int ka = (warp + kk * WARPS) * K_STEP + k_lane;
#pragma unroll
    for (int nt = 0; nt < N_TILES; ++nt) {
      // a lane's pair lies all inside H or all past it (H is a multiple of 8)
      const bool inside =
          forward_k_step(warp, kk) && nt * 8 + group < rows && (H % K_STEP == 0 || ka < H);
      fresh_pair(lane_src + nt * 8 * H + kk * WARPS * K_STEP, inside, frag[kk][nt][0],
                 frag[kk][nt][1]);
    }
  }
}

// load_step_fragments' n tile nt alone: frag[kk] for k-step kk of the warp.
__device__ __forceinline__ void load_tile_fragments(unsigned (&frag)[K_PER_WARP][2],
                                                    const elem_t* src, int nt) {
  const int warp = warp_index(), group = lane_group(), k_lane = lane_k();
  const elem_t* lane_src = src + group * H + warp * K_STEP + k_lane;
#pragma unroll
  for (int kk = 0; kk < K_PER_WARP; ++kk) {
    const int ka = (warp + kk * WARPS) * K_STEP + k_lane;
    const bool inside = forward_k_step(warp, kk) && nt * 8 + group < group_rows() &&
                        (H % K_STEP == 0 || ka < H);
    fresh_pair(lane_src + nt * 8 * H + kk * WARPS * K_STEP, inside, frag[kk][0], frag[kk][1]);
  }
}

// acc += the CTA's rows of W (A fragments in registers) times the step's input.
__device__ __forceinline__ void mma_registers(float (&acc)[M_TILES][N_TILES][4],
                                              const unsigned (&w_frag)[M_TILES][K_PER_WARP][4],
                                              const unsigned (&frag)[K_PER_WARP][N_TILES][2]) {
  const int warp = warp_index();
#pragma unroll
  for (int kk = 0; kk < K_PER_WARP; ++kk) {
    if (forward_k_step(warp, kk)) {
#pragma unroll
      for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt)
          mma(acc[mt][nt], w_frag[mt][kk], frag[kk][nt][0], frag[kk][nt][1]);
    }
  }
}

// C fragment: (row group, columns 2*quad, 2*quad+1) in acc[0..1], row group+8 in [2..3].
__device__ __forceinline__ void store_partial_sums(float (&partial)[WARPS][ROWS][COLS],
                                                   const float (&acc)[M_TILES][N_TILES][4]) {
  const int warp = warp_index(), group = lane_group(), quad = threadIdx.x % 4;
#pragma unroll
  for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
    for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
      for (int j = 0; j < 4; ++j)
        partial[warp][mt * 16 + group + 8 * (j / 2)][nt * 8 + 2 * quad + j % 2] = acc[mt][nt][j];
}

// LSTM_FORWARD_BY_N_TILE's step product: for each n tile in turn, acc = the CTA's rows
// of W times the tile of the step's input (src), stored to the warp's partial sums (as
// store_partial_sums). Two tiles' fragments are in flight: tile nt + 2's loads are issued
// behind tile nt's MMAs, so they arrive while tile nt + 1's run.
__device__ __forceinline__ void mma_by_n_tile(float (&partial)[WARPS][ROWS][COLS],
                                              const unsigned (&w_frag)[M_TILES][K_PER_WARP][4],
                                              const elem_t* src) {
  const int warp = warp_index(), group = lane_group(), quad = threadIdx.x % 4;
  unsigned frag[2][K_PER_WARP][2];
#pragma unroll
  for (int nt = 0; nt < 2 && nt < N_TILES; ++nt)
    if (LSTM_LEAVE_OUT != 2) load_tile_fragments(frag[nt], src, nt);
#pragma unroll
  for (int nt = 0; nt < N_TILES; ++nt) {
    float acc[M_TILES][4];
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[mt][j] = 0.0f;
    if (LSTM_LEAVE_OUT != 2) {
#pragma unroll
      for (int kk = 0; kk < K_PER_WARP; ++kk) {
        if (forward_k_step(warp, kk)) {
#pragma unroll
          for (int mt = 0; mt < M_TILES; ++mt)
            mma(acc[mt], w_frag[mt][kk], frag[nt % 2][kk][0], frag[nt % 2][kk][1]);
        }
      }
      if (nt + 2 < N_TILES) load_tile_fragments(frag[nt % 2], src, nt + 2);
    }
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
      for (int j = 0; j < 4; ++j)
        partial[warp][mt * 16 + group + 8 * (j / 2)][nt * 8 + 2 * quad + j % 2] = acc[mt][j];
  }
}

// The gates i, f, g, o from their pre-activations (in place).
__device__ __forceinline__ void activate(float* gate) {
  gate[0] = sigmoid(gate[0]);
  gate[1] = sigmoid(gate[1]);
  gate[2] = tanhf(gate[2]);
  gate[3] = sigmoid(gate[3]);
}

// The cell of (local unit u, batch row b): its gates' pre-activations (pre) from the
// warps' partial sums, the input side and the bias; updates c (fp32) and returns h.
__device__ __forceinline__ float cell_forward(const float (&partial)[WARPS][ROWS][COLS],
                                              const float (&x_side)[4], const float (&bias)[4],
                                              int u, int b, float& c, float (&pre)[4]) {
  float gate[4];
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    float sum = x_side[q] + bias[q];
#pragma unroll
    for (int w = 0; w < WARPS; ++w) sum += partial[w][q * UNITS + u][b];
    pre[q] = gate[q] = sum;
  }
  activate(gate);
  c = gate[1] * c + gate[0] * gate[2];
  return gate[3] * tanhf(c);
}

// y[t] = h at (batch row b, unit), and where asked (stash not null) the stash row the
// backward reads: the gates' pre-activations and c_t.
__device__ __forceinline__ void write_step(elem_t* y, elem_t* stash, int t, int b, int unit,
                                           float h, const float (&pre)[4], float c) {
  store(y + (static_cast<long long>(t) * BATCH + b) * H + unit, h);
  if (stash != nullptr) {
    elem_t* row = stash + (static_cast<long long>(t) * BATCH + b) * STASH + unit;
#pragma unroll
    for (int q = 0; q < 4; ++q) store(row + q * H, pre[q]);
    store(row + 4 * H, c);
  }
}

// All CTAs reach step `target / gridDim.x` before any goes on. A monotonic counter
// (zeroed by the host before the launch): thread 0 adds its arrival with release
// semantics after the CTA's stores (the __syncthreads orders them before it) and polls
// with acquire loads. Returns false where the wait timed out or another CTA's did.
__device__ __forceinline__ bool grid_barrier(unsigned* counter, unsigned target, int* status) {
  __shared__ int ok;
  __syncthreads();
  if (threadIdx.x == 0) {
    ok = 1;
    if (LSTM_BARRIER_FENCES) __threadfence();
    arrive_release(counter);
    unsigned long long start = global_ns();
    for (unsigned polls = 1;; ++polls) {
      if (load_acquire(counter) >= target) break;
      if (polls % 1024 == 0) {
        volatile int* flag = status;
        if (*flag != 0 || global_ns() - start > BARRIER_TIMEOUT_NS) {
          atomicExch(status, 1);
          ok = 0;
          break;
        }
      }
    }
    if (LSTM_BARRIER_FENCES) __threadfence();
  }
  __syncthreads();
  return ok != 0;
}

#ifndef LSTM_LAYERS  // the single layer's kernels (the wavefront's: below)
#if LSTM_DYNAMIC_SUMS
#ifndef LSTM_PTX_ON_CPU
extern __shared__ float dynamic_sums[];  // WARPS * ROWS * COLS of them
#else
#define dynamic_sums static_cast<float*>(dynamic_shared_memory)
#endif
#endif

extern "C" __global__ void __launch_bounds__(THREADS, 1)
lstm_persistent_forward(const elem_t* __restrict__ xw,    // [T, BATCH, 4H]: x W_ih^T + b_ih
                        const elem_t* __restrict__ w_hh,  // [4H, H]
                        const float* __restrict__ b_hh,   // [4H], fp32
                        const elem_t* __restrict__ h0,    // [BATCH, H]
                        const elem_t* __restrict__ c0,    // [BATCH, H]
                        elem_t* y,                        // [T, BATCH, H]: h_t of every step
                        elem_t* __restrict__ h_n,         // [BATCH, H]
                        elem_t* __restrict__ c_n,         // [BATCH, H]
                        elem_t* __restrict__ stash,       // [T, BATCH, 5H], the backward's, or null
                        unsigned* counter,                // barrier arrivals: group g's at [32 g]
                        int* status,                      // set to 1 where a barrier timed out
                        int T) {
#if LSTM_DYNAMIC_SUMS
  auto& partial = *reinterpret_cast<float (*)[WARPS][ROWS][COLS]>(dynamic_sums);
#else
  __shared__ float partial[WARPS][ROWS][COLS];  // each warp's sums over its k-steps
#endif
  const int unit0 = blockIdx.x * UNITS;
  if (GROUPS > 1) {  // the group's rows and barrier (the head comment's batch groups)
    xw += group_offset(4 * H);
    h0 += group_offset(H);
    c0 += group_offset(H);
    y += group_offset(H);
    h_n += group_offset(H);
    c_n += group_offset(H);
    if (stash != nullptr) stash += group_offset(STASH);
    counter += blockIdx.y * COUNTER_STRIDE;
  }

  // This warp's slice of W_hh: in registers for all T steps.
  unsigned w_frag[M_TILES][K_PER_WARP][4];
  load_row_fragments(w_frag, w_hh, unit0);

  // c of this thread's cells stays in registers across steps (fp32).
  float c[CELLS_PER_THREAD], bias[CELLS_PER_THREAD][4], x_side[CELLS_PER_THREAD][4];
#pragma unroll
  for (int i = 0; i < CELLS_PER_THREAD; ++i) {
    int unit, b;
    const bool mine = my_cell(i, unit0, unit, b);
    c[i] = mine ? to_float(c0[b * H + unit]) : 0.0f;
#pragma unroll
    for (int q = 0; q < 4; ++q) bias[i][q] = mine ? b_hh[q * H + unit] : 0.0f;
  }
  load_x_side(x_side, xw, 0, unit0);

  for (int t = 0; t < T; ++t) {
    const elem_t* h_prev = t == 0 ? h0 : y + static_cast<long long>(t - 1) * BATCH * H;
#if LSTM_FORWARD_BY_N_TILE
    mma_by_n_tile(partial, w_frag, h_prev);
#else
    float acc[M_TILES][N_TILES][4];
    zero(acc);
    unsigned h_frag[K_PER_WARP][N_TILES][2];
    if (LSTM_LEAVE_OUT != 2) {
      load_step_fragments(h_frag, h_prev);
      mma_registers(acc, w_frag, h_frag);
    }
    store_partial_sums(partial, acc);
#endif
    __syncthreads();

#pragma unroll
    for (int i = 0; i < CELLS_PER_THREAD; ++i) {
      int unit, b;
      if (my_cell(i, unit0, unit, b)) {
        float pre[4];
        const float h = cell_forward(partial, x_side[i], bias[i], unit - unit0, b, c[i], pre);
        write_step(y, stash, t, b, unit, h, pre, c[i]);
        if (t == T - 1) {
          const long long at = static_cast<long long>(b) * H + unit;
          store(h_n + at, h);
          store(c_n + at, c[i]);
        }
      }
    }

    if (t + 1 < T) {
      load_x_side(x_side, xw, t + 1, unit0);
      if (LSTM_LEAVE_OUT != 1 &&
          !grid_barrier(counter, gridDim.x * static_cast<unsigned>(t + 1), status))
        return;
    }
  }
}

// What step t's cell backward reads besides dh_t's product: it does not depend on the
// recurrence, so it is loaded a step ahead, before the barrier wait. side[i] holds
// dy_t (plus dh_n at t = T-1; zero at t = -1), the gates' pre-activations i, f, g, o
// (activated at the step's start: ``activate``), c_t and c_{t-1}.
constexpr int SIDE = 7;
__device__ __forceinline__ void load_cell_side(float (&side)[CELLS_PER_THREAD][SIDE],
                                               const elem_t* stash, const elem_t* c0,
                                               const elem_t* dy, const elem_t* dh_n, int t,
                                               int T, int unit0) {
#pragma unroll
  for (int i = 0; i < CELLS_PER_THREAD; ++i) {
    int unit, b;
    const bool mine = my_cell(i, unit0, unit, b) && t >= 0;
    const long long at = static_cast<long long>(b) * H + unit;
    const elem_t* row = stash + (static_cast<long long>(t) * BATCH + b) * STASH + unit;
    side[i][0] = mine ? to_float(dy[static_cast<long long>(t) * BATCH * H + at]) : 0.0f;
    if (mine && t == T - 1) side[i][0] += to_float(dh_n[at]);
#pragma unroll
    for (int q = 0; q < 5; ++q) side[i][1 + q] = mine ? to_float(row[q * H]) : 0.0f;
    side[i][6] = !mine ? 0.0f : t == 0 ? to_float(c0[at]) : to_float(row[4 * H - BATCH * STASH]);
  }
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
lstm_persistent_backward(const elem_t* __restrict__ w_hh,  // [4H, H]
                         const elem_t* __restrict__ stash, // [T, BATCH, 5H]: the forward's
                         const elem_t* __restrict__ c0,    // [BATCH, H]
                         const elem_t* __restrict__ dy,    // [T, BATCH, H]: gradient of y
                         const elem_t* __restrict__ dh_n,  // [BATCH, H]
                         const elem_t* __restrict__ dc_n,  // [BATCH, H]
                         elem_t* dgates,                   // [T, BATCH, 4H]: gradient of the gates
                         elem_t* __restrict__ dh0,         // [BATCH, H]
                         elem_t* __restrict__ dc0,         // [BATCH, H]
                         unsigned* counter,                // barrier arrivals: group g's at [32 g]
                         int* status,                      // set to 1 where a barrier timed out
                         int T) {
  __shared__ float partial[WARPS][BWD_M_TILES * 16][BWD_N_TILES * 8];

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int group = lane / 4;  // the fragments' row (A, C) or column (B) in the tile
  const int quad = lane % 4;   // and position along K
  const int k_lane = 2 * PER_WORD * quad;  // the lane's first k in a k-step (PER_WORD)
  const int unit0 = blockIdx.x * UNITS;
  const int rows_here = group_rows();
  if (GROUPS > 1) {  // the group's rows and barrier (the head comment's batch groups)
    stash += group_offset(STASH);
    c0 += group_offset(H);
    dy += group_offset(H);
    dh_n += group_offset(H);
    dc_n += group_offset(H);
    dgates += group_offset(G);
    dh0 += group_offset(H);
    dc0 += group_offset(H);
    counter += blockIdx.y * COUNTER_STRIDE;
  }

  // This warp's slice of W_hh^T as B fragments: column (unit) nt*8 + group, k-step
  // warp + kk*WARPS, words at kb (b0) and kb + PER_WORD (b1); zero past the CTA's units.
  unsigned w_frag[BWD_K_PER_WARP][BWD_N_TILES][2];
#pragma unroll
  for (int kk = 0; kk < BWD_K_PER_WARP; ++kk) {
    const int step = warp + kk * WARPS;
    const int kb = step * K_STEP + k_lane;
#pragma unroll
    for (int nt = 0; nt < BWD_N_TILES; ++nt) {
      const int n = nt * 8 + group;
      const bool inside = n < UNITS && unit0 + n < H && step < BWD_K_STEPS;
#pragma unroll
      for (int half = 0; half < 2; ++half)
        w_frag[kk][nt][half] = inside ? column_word(w_hh, kb + half * PER_WORD, unit0 + n) : 0u;
    }
  }

  // dc of this thread's cells stays in registers across steps (fp32).
  float dc[CELLS_PER_THREAD], side[CELLS_PER_THREAD][SIDE];
#pragma unroll
  for (int i = 0; i < CELLS_PER_THREAD; ++i) {
    int unit, b;
    dc[i] = my_cell(i, unit0, unit, b) ? to_float(dc_n[b * H + unit]) : 0.0f;
  }
  load_cell_side(side, stash, c0, dy, dh_n, T - 1, T, unit0);

  // Step t = -1 only runs the product: dh0 = dgates_0 W_hh.
  for (int t = T - 1; t >= -1; --t) {
    // The gates of step t, loaded before the barrier, activated here: the work overlaps
    // the step's dgates loads, and the loads' latency stays behind the barrier's wait.
    if (t >= 0) {
#pragma unroll
      for (int i = 0; i < CELLS_PER_THREAD; ++i) activate(&side[i][1]);
    }
    float acc[BWD_CHAINS][BWD_M_TILES][BWD_N_TILES][4];
#pragma unroll
    for (int ch = 0; ch < BWD_CHAINS; ++ch)
#pragma unroll
      for (int mt = 0; mt < BWD_M_TILES; ++mt)
#pragma unroll
        for (int nt = 0; nt < BWD_N_TILES; ++nt)
#pragma unroll
          for (int j = 0; j < 4; ++j) acc[ch][mt][nt][j] = 0.0f;

    if (LSTM_LEAVE_OUT != 2 && t + 1 < T) {
      // dgates_{t+1} as A fragments: rows m, m + 8 at word ka (a0, a1) and ka + PER_WORD
      // (a2, a3), m = mt*16 + group; all of the step's loads before its MMAs, as the
      // forward.
      const elem_t* dg_lane = dgates + (static_cast<long long>(t + 1) * BATCH + group) * G +
                              warp * K_STEP + k_lane;
      unsigned dg_frag[BWD_K_PER_WARP][BWD_M_TILES][4];
#pragma unroll
      for (int kk = 0; kk < BWD_K_PER_WARP; ++kk)
#pragma unroll
        for (int mt = 0; mt < BWD_M_TILES; ++mt)
#pragma unroll
          for (int half = 0; half < 2; ++half) {  // rows m, m + 8
            const int rows = mt * 16 + 8 * half;  // past the lane's row group
            const bool inside = backward_k_step(warp, kk) && rows + group < rows_here;
            fresh_pair(dg_lane + rows * G + kk * WARPS * K_STEP, inside, dg_frag[kk][mt][half],
                       dg_frag[kk][mt][2 + half]);
          }
#pragma unroll
      for (int kk = 0; kk < BWD_K_PER_WARP; ++kk) {
        if (backward_k_step(warp, kk)) {
#pragma unroll
          for (int mt = 0; mt < BWD_M_TILES; ++mt)
#pragma unroll
            for (int nt = 0; nt < BWD_N_TILES; ++nt)
              mma(acc[kk % BWD_CHAINS][mt][nt], dg_frag[kk][mt], w_frag[kk][nt][0],
                  w_frag[kk][nt][1]);
        }
      }
    }

    // C fragment: (batch row group, units 2*quad, 2*quad+1) in acc[0..1], row group+8 in [2..3].
#pragma unroll
    for (int mt = 0; mt < BWD_M_TILES; ++mt)
#pragma unroll
      for (int nt = 0; nt < BWD_N_TILES; ++nt)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          float sum = 0.0f;
#pragma unroll
          for (int ch = 0; ch < BWD_CHAINS; ++ch) sum += acc[ch][mt][nt][j];
          partial[warp][mt * 16 + group + 8 * (j / 2)][nt * 8 + 2 * quad + j % 2] = sum;
        }
    __syncthreads();

#pragma unroll
    for (int i = 0; i < CELLS_PER_THREAD; ++i) {
      int unit, b;
      if (my_cell(i, unit0, unit, b)) {
        float dh = side[i][0];
#pragma unroll
        for (int w = 0; w < WARPS; ++w) dh += partial[w][b][unit - unit0];
        const long long at = static_cast<long long>(b) * H + unit;
        if (t >= 0) {
          const float gi = side[i][1], gf = side[i][2], gg = side[i][3], go = side[i][4];
          const float tanh_c = tanhf(side[i][5]);
          const float dc_t = dc[i] + dh * go * (1.0f - tanh_c * tanh_c);
          elem_t* row = dgates + (static_cast<long long>(t) * BATCH + b) * G + unit;
          store(row, dc_t * gg * gi * (1.0f - gi));
          store(row + H, dc_t * side[i][6] * gf * (1.0f - gf));
          store(row + 2 * H, dc_t * gi * (1.0f - gg * gg));
          store(row + 3 * H, dh * tanh_c * go * (1.0f - go));
          dc[i] = dc_t * gf;
        } else {
          store(dh0 + at, dh);
          store(dc0 + at, dc[i]);
        }
      }
    }

    if (t >= 0) {
      load_cell_side(side, stash, c0, dy, dh_n, t - 1, T, unit0);
      if (LSTM_LEAVE_OUT != 1 &&
          !grid_barrier(counter, gridDim.x * static_cast<unsigned>(T - t), status))
        return;
    }
  }
}

#endif  // LSTM_LAYERS

#ifdef LSTM_LAYERS
// The wavefront: a stack of LSTM_LAYERS unidirectional layers of H units each, all of
// them in one launch. CTA p belongs to layer p / CTAS_PER_LAYER (the per-layer layout
// above, side by side); at tick k layer l runs its step t = k - l (idle outside
// 0..T-1), so the stack takes T + L - 1 ticks, one grid barrier each, instead of L x T
// steps. Layer l > 0's input at step t is layer l-1's h_t, written at tick k - 1: behind
// the barrier, as h_{t-1} of its own layer is. Its input product W_ih h^{l-1}_t + b_ih
// runs in-kernel beside the recurrent one (both into the same sums), its W_ih rows in
// dynamic shared memory (registers hold W_hh); layer 0's is x W_ih^T + b_ih, one GEMM
// before the launch, as the single layer's. Dropout between layers: layer l-1's cell
// also writes h * mask (the mask a tensor from torch) to `dropped`, which layer l reads.
constexpr int LAYERS = LSTM_LAYERS;
constexpr int CTAS_PER_LAYER = (H + UNITS - 1) / UNITS;
constexpr int W_IH_TILES = M_TILES * K_PER_WARP;  // a thread's A fragments of W_ih
static_assert(LAYERS >= 2, "a wavefront needs two layers or more");
static_assert(GROUPS == 1 && !LSTM_DYNAMIC_SUMS,
              "a wavefront runs one batch group, its partial sums in static shared memory");

// Each layer's weights and outputs apart (passed by value): the parameters as they are,
// and outputs the op keeps as tensors of their own.
struct LayerWeights {
  const elem_t* w_ih[LAYERS];  // [4H, H] of layers 1..L-1 (w_ih[0] is not read)
  const elem_t* w_hh[LAYERS];  // [4H, H]
};
struct LayerOutputs {
  elem_t* y[LAYERS];     // [T, B, H]: h_t of every step
  elem_t* stash[LAYERS];  // [T, B, 5H] for the backward, or null
};

// A thread's W_ih fragment (mt, kk) in the dynamic shared memory: the 4 words of thread
// i at [(mt * K_PER_WARP + kk) * THREADS + i]: a warp's loads are 512 contiguous bytes.
struct alignas(16) FragmentWords {
  unsigned word[4];
};
static_assert(sizeof(FragmentWords) * W_IH_TILES * THREADS <= 227 * 1024,
              "W_ih's fragments exceed the shared memory a CTA may opt in to (sm_90)");

__device__ __forceinline__ void mma_shared(float (&acc)[M_TILES][N_TILES][4],
                                           const FragmentWords* w_shared,
                                           const unsigned (&frag)[K_PER_WARP][N_TILES][2]) {
  const int warp = warp_index();
#pragma unroll
  for (int kk = 0; kk < K_PER_WARP; ++kk) {
    if (forward_k_step(warp, kk)) {
#pragma unroll
      for (int mt = 0; mt < M_TILES; ++mt) {
        const FragmentWords a = w_shared[(mt * K_PER_WARP + kk) * THREADS + threadIdx.x];
        const unsigned w[4] = {a.word[0], a.word[1], a.word[2], a.word[3]};
#pragma unroll
        for (int nt = 0; nt < N_TILES; ++nt)
          mma(acc[mt][nt], w, frag[kk][nt][0], frag[kk][nt][1]);
      }
    }
  }
}

#ifndef LSTM_PTX_ON_CPU
extern __shared__ FragmentWords dynamic_shared[];  // W_IH_TILES * THREADS of them
#else
#define dynamic_shared static_cast<FragmentWords*>(dynamic_shared_memory)
#endif

// No parentheses in the parameters' comments: tests read the signature up to the first.
extern "C" __global__ void __launch_bounds__(THREADS, 1)
lstm_wavefront_forward(const elem_t* __restrict__ xw,    // [T, B, 4H]: layer 0's x W_ih^T + b_ih
                       const LayerWeights weights,       // W_ih and W_hh of each layer
                       const float* __restrict__ bias,   // [L, 4H] fp32: b_hh, plus b_ih past 0
                       const elem_t* __restrict__ h0,    // [L, B, H]
                       const elem_t* __restrict__ c0,    // [L, B, H]
                       const elem_t* __restrict__ mask,  // [L-1, T, B, H]: dropout's mask, 0 or
                                                         // 1/[1-p], on layer l+1's input; or null
                       elem_t* dropped,                  // [L-1, T, B, H]: y * mask, where masked
                       const LayerOutputs outputs,       // y and stash of each layer
                       elem_t* __restrict__ h_n,         // [L, B, H]
                       elem_t* __restrict__ c_n,         // [L, B, H]
                       unsigned* counter,                // barrier arrivals, zero at launch
                       int* status,                      // set to 1 where a barrier timed out
                       int T) {
  __shared__ float partial[WARPS][ROWS][COLS];  // each warp's sums over its k-steps
  const int layer = blockIdx.x / CTAS_PER_LAYER;
  const int unit0 = (blockIdx.x % CTAS_PER_LAYER) * UNITS;
  const long long steps = static_cast<long long>(T) * B * H;  // one layer's y
  elem_t* my_y = outputs.y[layer];
  elem_t* my_stash = outputs.stash[layer];
  // Layer l > 0 reads layer l-1's output, dropped where a mask is given.
  const elem_t* input = layer == 0 ? nullptr
                        : mask == nullptr ? outputs.y[layer - 1]
                                          : dropped + (layer - 1) * steps;
  // Layer l < L-1 writes its output dropped for layer l+1.
  const elem_t* my_mask = mask == nullptr || layer == LAYERS - 1 ? nullptr : mask + layer * steps;
  elem_t* my_dropped = my_mask == nullptr ? nullptr : dropped + layer * steps;

  unsigned w_frag[M_TILES][K_PER_WARP][4];  // W_hh: in registers for all ticks
  load_row_fragments(w_frag, weights.w_hh[layer], unit0);
  if (layer > 0) {  // W_ih to shared memory, through the same registers' layout
    unsigned w_ih_frag[M_TILES][K_PER_WARP][4];
    load_row_fragments(w_ih_frag, weights.w_ih[layer], unit0);
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
      for (int kk = 0; kk < K_PER_WARP; ++kk) {
        FragmentWords& a = dynamic_shared[(mt * K_PER_WARP + kk) * THREADS + threadIdx.x];
#pragma unroll
        for (int r = 0; r < 4; ++r) a.word[r] = w_ih_frag[mt][kk][r];
      }
  }

  // c of this thread's cells stays in registers across steps (fp32).
  float c[CELLS_PER_THREAD], cell_bias[CELLS_PER_THREAD][4], x_side[CELLS_PER_THREAD][4];
#pragma unroll
  for (int i = 0; i < CELLS_PER_THREAD; ++i) {
    int unit, b;
    const bool mine = my_cell(i, unit0, unit, b);
    c[i] = mine ? to_float(c0[(static_cast<long long>(layer) * B + b) * H + unit]) : 0.0f;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      cell_bias[i][q] = mine ? bias[(layer * 4 + q) * H + unit] : 0.0f;
      x_side[i][q] = 0.0f;  // layer 0's is loaded a step ahead; the others' is in the sums
    }
  }
  if (layer == 0) load_x_side(x_side, xw, 0, unit0);

  const int ticks = T + LAYERS - 1;
  for (int tick = 0; tick < ticks; ++tick) {
    const int t = tick - layer;
    if (0 <= t && t < T) {
      const elem_t* h_prev = t == 0 ? h0 + static_cast<long long>(layer) * B * H
                                    : my_y + static_cast<long long>(t - 1) * B * H;
      float acc[M_TILES][N_TILES][4];
      zero(acc);
      if (LSTM_LEAVE_OUT != 2) {
        unsigned h_frag[K_PER_WARP][N_TILES][2];
        if (layer > 0) {
          unsigned in_frag[K_PER_WARP][N_TILES][2];
          load_step_fragments(in_frag, input + static_cast<long long>(t) * B * H);
          load_step_fragments(h_frag, h_prev);
          mma_shared(acc, dynamic_shared, in_frag);
        } else {
          load_step_fragments(h_frag, h_prev);
        }
        mma_registers(acc, w_frag, h_frag);
      }
      store_partial_sums(partial, acc);
      __syncthreads();

#pragma unroll
      for (int i = 0; i < CELLS_PER_THREAD; ++i) {
        int unit, b;
        if (my_cell(i, unit0, unit, b)) {
          float pre[4];
          const float h = cell_forward(partial, x_side[i], cell_bias[i], unit - unit0, b, c[i],
                                       pre);  // fmt: skip
          write_step(my_y, my_stash, t, b, unit, h, pre, c[i]);
          const long long at = (static_cast<long long>(t) * B + b) * H + unit;
          if (my_mask != nullptr)  // as torch's y * mask: y rounded to its dtype first
            store(my_dropped + at, to_float(my_y[at]) * to_float(my_mask[at]));
          if (t == T - 1) {
            const long long last = (static_cast<long long>(layer) * B + b) * H + unit;
            store(h_n + last, h);
            store(c_n + last, c[i]);
          }
        }
      }
      if (layer == 0 && t + 1 < T) load_x_side(x_side, xw, t + 1, unit0);
    }
    if (tick + 1 < ticks && LSTM_LEAVE_OUT != 1 &&
        !grid_barrier(counter, gridDim.x * static_cast<unsigned>(tick + 1), status))
      return;
  }
}
#endif
