// W4A16 GEMM for 9..GEMM_MAX_M rows of x on tensor cores, and the dequantization of the
// repacked weight for larger M (then cuBLAS), both reading the layout of w4_gemv.cu (whose
// helpers this file uses: load_inline compiles the two sources as one unit, w4_gemv.cu first).
//
// The GEMM swaps the MMA's operands against the GEMV: x is the A operand (16 rows of x per
// m16n8k16 MMA) and the weight the B operand (8 columns), so that one dequantized weight
// fragment serves every row of x in the block. A lane's uint4 of a chunk (words {step 0 col g,
// step 0 col g + 8, step 1 col g, step 1 col g + 8}) is exactly its B fragments of the chunk's
// eight MMAs per 16 rows: word 2 s + h, dequantized to the pairs (K offsets 0 1) (2 3) (4 5)
// (6 7), is b0 b1 of the step's first k16 MMA and b0 b1 of its second. x's A fragments are
// ldmatrix loads from a shared-memory tile whose K order is permuted to match (GemmStage), so
// the four registers come out in MMA order (16-byte loads of x rows in K order needed a dozen
// register moves per MMA to build the fragments).
// The group scale multiplies the dequantized q - z in x's dtype (scales are in x's dtype), so
// each weight is (q - z) * s rounded once, as the reference `dequantize(w, dtype)` rounds it.
//
// Work split: a block's WARPS warps each own NT 16-column tiles (block: 16 NT WARPS columns),
// all rows of an MT x 16 row block (grid z), and one K range (grid y: split-K). With KW > 1 the
// block has KW groups of WARPS warps, each with its own cp.async ring, taking every KW-th chunk
// of the range; their sums meet in shared memory at the end (more warps per SM on the same
// columns without split-K's fp32 partials in global memory: the H200 ran 112-block grids with
// 8 warps per SM, 12% occupancy, 60% of cycles with no eligible warp). With split-K each block
// writes fp32 partial sums that w4_sum_partials adds (with the bias); else the block writes the
// output. No atomics, no host syncs: CUDA-graph safe.

namespace w4 {

template <typename T>
__device__ __forceinline__ typename Dequant<T>::T2 pair_of(T v);
template <>
__device__ __forceinline__ __half2 pair_of<__half>(__half v) { return __half2half2(v); }
template <>
__device__ __forceinline__ __nv_bfloat162 pair_of<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162bfloat162(v);
}

template <typename T>
__device__ __forceinline__ uint32_t scale_pair(uint32_t v, typename Dequant<T>::T2 s) {
  return as_u32(__hmul2(from_u32<typename Dequant<T>::T2>(v), s));
}

constexpr int kStages = 4;  // chunks in flight per block (cp.async ring)
constexpr int kXPad = 8;    // x row stride 64 + 8 elements (144 B: ldmatrix's 8 rows hit 8 bank groups)

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const int bytes = valid ? 16 : 0;  // 0: zero-fill (rows / columns / K past the end)
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(bytes));
}
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem, bool valid) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const int bytes = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(gmem), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
// Four 8 x 8 16-bit matrices from shared memory, each lane's registers in m16n8k16 A-fragment
// order (a0..a3) when lanes 8 i .. 8 i + 7 give the row addresses of matrix i.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&a)[4], uint32_t smem_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3])
               : "r"(smem_addr));
}

// Shared memory of one stage (one 64-row K chunk), in 16-byte units. x's rows are stored with
// each k32 step's K order permuted so that ldmatrix hands a lane exactly the pairs the weight
// fragments pair it with: step offset 8 t + 2 j + e (lane t's pair j, as the repacked words
// hold K) is stored at 8 j + 2 t + e, so that 16-byte row piece j of a step holds pair j of
// lanes t = 0..3, which ldmatrix gives lane 4 g + t as its element pair (row g, 2 t).
template <int MT, int NT>
struct GemmStage {
  static constexpr int kRows = MT * 16;
  static __host__ __device__ constexpr int weights(int warps) { return warps * NT * 32; }
  static constexpr int kXRow = (kChunkK + kXPad) * 2 / 16;  // 9
  static constexpr int kX = kRows * kXRow;
  static __host__ __device__ constexpr int params(int warps) {  // scales (and zeros): 2 steps
    return 2 * warps * NT * kTileN * 2 / 16;
  }
  static __host__ __device__ constexpr int size(int warps, bool zeros) {
    return weights(warps) + kX + params(warps) * (zeros ? 2 : 1);
  }
};

template <typename T, bool HAS_ZEROS, int WARPS, int MT, int NT, int KW>
__global__ void __launch_bounds__(WARPS * KW * 32, 16 / (WARPS * KW)) w4_gemm_kernel(  // <= 128 regs
    const T* __restrict__ x,             // [M, K]
    const uint4* __restrict__ qweight,   // [N_pad / 16, K_pad / 64, 32] uint4 (repacked)
    const T* __restrict__ scales,        // [G, N] in x's dtype
    const int16_t* __restrict__ zeros,   // [G, N] (HAS_ZEROS)
    const T* __restrict__ bias,          // [N] or nullptr (no split-K)
    T* __restrict__ out,                 // [M, N] (no split-K)
    float* __restrict__ partial,         // [split, M, N] or nullptr
    int m, int n, int k, int num_groups, float inv_group, int zero_value, int chunks_per_split) {
  using T2 = typename Dequant<T>::T2;
  using Stage = GemmStage<MT, NT>;
  extern __shared__ uint4 smem[];
  constexpr int warps = WARPS;
  const int lane = threadIdx.x % 32;
  const int warp = (threadIdx.x / 32) % WARPS;  // in its K group
  const int kg = threadIdx.x / (32 * WARPS);    // K group: chunks c_begin + kg, + KW, ...
  const int tid = threadIdx.x % (32 * WARPS);   // thread in its K group
  const int g = lane / 4;
  const int t = lane % 4;
  constexpr int block_cols = warps * NT * kTileN;
  const int col_base = blockIdx.x * block_cols;   // the block's first output column
  const int num_tiles = (n + kTileN - 1) / kTileN;
  const int num_chunks = (k + kChunkK - 1) / kChunkK;
  const int c_begin = blockIdx.y * chunks_per_split;
  const int c_end = min(c_begin + chunks_per_split, num_chunks);
  const int row0 = blockIdx.z * Stage::kRows;
  const int num_iters = (c_end - c_begin + KW - 1) / KW;  // chunks per K group (the last: <=)
  constexpr int stage_size = Stage::size(warps, HAS_ZEROS);
  constexpr int w_units = Stage::weights(warps), p_units = Stage::params(warps);

  // What this thread copies in every chunk, from addresses that move by a fixed step per chunk:
  // - weights: uint4 `lane` of tiles warp + j warps (j < NT), 32 uint4 per chunk;
  // - x: pair `lane` (K 2 lane, 2 lane + 1 of the chunk) of rows warp, warp + warps, ... to
  //   its permuted place (GemmStage);
  // - scales / zeros: 16-byte piece `tid` of the block's [step][columns] (few threads:
  //   p_mine).
  // Each K group copies its own chunks into its own ring (indices within the group).
  const uint4* w_src[NT];
  bool w_ok[NT];
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const int tile = col_base / kTileN + warp + j * warps;
    w_ok[j] = tile < num_tiles;
    w_src[j] = qweight + static_cast<size_t>(w_ok[j] ? tile : 0) * num_chunks * 32 + lane;
  }
  const int pair_step = lane / 16, pair_q = lane % 16;  // q = 4 t + j
  const int x_dst = (32 * pair_step + 8 * (pair_q % 4) + 2 * (pair_q / 4)) * 2;  // bytes
  static_assert(Stage::kRows % warps == 0, "whole rows of x per warp");
  // Offsets of this lane's pair in rows warp + i warps. Copies past M or K are zero-filled
  // from a valid address: row M - 1, and the chunk's offset dropped. M K < 2^27: ints.
  bool x_row_ok[Stage::kRows / warps];
  int x_off[Stage::kRows / warps];
#pragma unroll
  for (int i = 0; i < Stage::kRows / warps; ++i) {
    const int row = row0 + warp + i * warps;
    x_row_ok[i] = row < m;
    x_off[i] = min(row, m - 1) * k + min(2 * lane, k - 2);
  }

  // Scales, then zeros: [step][8-column piece] units, at most one per thread (NT <= 4).
  const int p_pieces = p_units / 2;
  const bool p_mine = tid < p_units * (HAS_ZEROS ? 2 : 1);
  const bool p_zero = tid >= p_units;
  const int p_j = tid % p_units;
  const int p_step = p_j / p_pieces, p_col = col_base + (p_j % p_pieces) * 8;
  const bool p_ok = p_col < n;

  uint4* ring = smem + kg * kStages * stage_size;
  auto load_chunk = [&](int c, int slot) {
    uint4* st = ring + slot * stage_size;
#pragma unroll
    for (int j = 0; j < NT; ++j) {  // [warp + j warps][lane] = w_units / threads per thread
      cp_async16(st + (warp + j * warps) * 32 + lane, w_src[j] + static_cast<size_t>(c) * 32,
                 w_ok[j]);
    }
    char* sx = reinterpret_cast<char*>(st + w_units) + warp * Stage::kXRow * 16;
    const bool k_ok = c * kChunkK + 2 * lane < k;
    const int k_off = k_ok ? c * kChunkK : 0;
#pragma unroll
    for (int i = 0; i < Stage::kRows / warps; ++i) {  // rows warp + i warps
      cp_async4(sx + x_dst + i * warps * Stage::kXRow * 16, x + x_off[i] + k_off,
                k_ok && x_row_ok[i]);
    }
    if (p_mine) {
      const int grp = group_of(c * kChunkK + 32 * p_step, inv_group, num_groups - 1);
      const size_t off = p_ok ? static_cast<size_t>(grp) * n + p_col : 0;
      const void* src = p_zero ? static_cast<const void*>(zeros + off)
                               : static_cast<const void*>(scales + off);
      cp_async16(st + w_units + Stage::kX + tid, src, p_ok);
    }
  };

  float acc[MT][NT][2][4];
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[i][j][h][e] = 0.f;

  // ldmatrix row address of this lane: matrix lane / 8 = (rows + 8 (i & 1), piece i / 2).
  const int lm = lane / 8, lr = lane % 8;
  const uint32_t x_lane = ((lr + 8 * (lm & 1)) * Stage::kXRow + (lm / 2)) * 16;

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    const int c = c_begin + s * KW + kg;
    if (c < c_end) load_chunk(c, s);
    cp_async_commit();
  }
  for (int it = 0; it < num_iters; ++it) {
    cp_async_wait<kStages - 2>();
    __syncthreads();  // iteration it's chunks landed for every thread; slot it - 1 is free again
    const int c_next = c_begin + (it + kStages - 1) * KW + kg;
    if (c_next < c_end) load_chunk(c_next, (it + kStages - 1) % kStages);
    cp_async_commit();
    if (c_begin + it * KW + kg >= c_end) continue;  // the last iteration: no chunk (group-uniform)
    const uint4* st = ring + (it % kStages) * stage_size;
    const uint4* sx = st + w_units;
    const uint32_t sx_addr = static_cast<uint32_t>(__cvta_generic_to_shared(sx)) + x_lane;
    const T* sscale = reinterpret_cast<const T*>(sx + Stage::kX);
    const int16_t* szero = reinterpret_cast<const int16_t*>(sx + Stage::kX + p_units);
    uint4 wv[NT];
#pragma unroll
    for (int j = 0; j < NT; ++j) wv[j] = st[(warp * NT + j) * 32 + lane];
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      uint32_t b[NT][2][4];  // [tile][half][pair]: (q - z) * scale, K offsets (0 1) .. (6 7)
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const uint32_t words[4] = {wv[j].x, wv[j].y, wv[j].z, wv[j].w};
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int local = (warp * NT + j) * kTileN + 8 * h + g;  // column in the block
          const int z = HAS_ZEROS ? szero[s * block_cols + local] : zero_value;
          Dequant<T>::run(words[2 * s + h], z, b[j][h]);
          const T2 sc = pair_of<T>(sscale[s * block_cols + local]);
#pragma unroll
          for (int p = 0; p < 4; ++p) b[j][h][p] = scale_pair<T>(b[j][h][p], sc);
        }
      }
#pragma unroll
      for (int i = 0; i < MT; ++i) {
        uint32_t a_lo[4], a_hi[4];  // pieces (0, 1) and (2, 3) of step s, rows 16 i ..
        const uint32_t base = sx_addr + (16 * i * Stage::kXRow + 4 * s) * 16;
        ldmatrix_x4(a_lo, base);
        ldmatrix_x4(a_hi, base + 2 * 16);
#pragma unroll
        for (int j = 0; j < NT; ++j) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            mma_16816<T>(acc[i][j][h], a_lo, b[j][h][0], b[j][h][1]);
            mma_16816<T>(acc[i][j][h], a_hi, b[j][h][2], b[j][h][3]);
          }
        }
      }
    }
  }
  cp_async_wait<0>();
  if (KW > 1) {  // groups 1.. hand their sums to group 0 through the (now idle) ring memory
    constexpr int kAcc = MT * NT * 2 * 4;
    float* red = reinterpret_cast<float*>(smem);  // [kAcc][KW - 1][WARPS * 32]
    __syncthreads();
    float* flat = &acc[0][0][0][0];  // [kAcc], registers (every index a constant once unrolled)
    if (kg > 0) {
#pragma unroll
      for (int a = 0; a < kAcc; ++a) red[(a * (KW - 1) + kg - 1) * WARPS * 32 + tid] = flat[a];
    }
    __syncthreads();
    if (kg > 0) return;
#pragma unroll
    for (int a = 0; a < kAcc; ++a)
#pragma unroll
      for (int q = 0; q < KW - 1; ++q) flat[a] += red[(a * (KW - 1) + q) * WARPS * 32 + tid];
    static_assert(kAcc * (KW - 1) * WARPS * 32 * 4 <= KW * kStages * stage_size * 16,
                  "the reduction fits in the rings");
  }

  // C fragment: rows g (e 0 1) and g + 8 (e 2 3), columns 2 t and 2 t + 1 of the 8-column half.
  const int tile0 = col_base / kTileN + warp * NT;
#pragma unroll
  for (int i = 0; i < MT; ++i) {
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int row = row0 + 16 * i + g + 8 * (e / 2);
          const int col = (tile0 + j) * kTileN + 8 * h + 2 * t + e % 2;
          if (row >= m || col >= n) continue;
          const size_t o = static_cast<size_t>(row) * n + col;
          if (partial != nullptr) {
            partial[static_cast<size_t>(blockIdx.y) * m * n + o] = acc[i][j][h][e];
          } else {
            float v = acc[i][j][h][e];
            if (bias != nullptr) v += to_float(bias[col]);
            out[o] = from_float<T>(v);
          }
        }
      }
    }
  }
}

// out [M, N] = sum over splits of partial [split, M, N] (+ bias), in x's dtype.
template <typename T>
__global__ void w4_sum_partials(const float* __restrict__ partial, const T* __restrict__ bias,
                                T* __restrict__ out, int mn, int n, int split) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= mn) return;
  float v = 0.f;
  for (int s = 0; s < split; ++s) v += partial[static_cast<size_t>(s) * mn + i];
  if (bias != nullptr) v += to_float(bias[i % n]);
  out[i] = from_float<T>(v);
}

// W [N, K] in x's dtype from the repacked weight: one thread per (tile, chunk, lane) uint4,
// writing 8 consecutive K values of each of its 4 (column, step) words as one 16-byte store.
// Each value is (q - z) * scale in fp32 rounded once (the reference's `dequantize(w, dtype)`).
template <typename T, bool HAS_ZEROS>
__global__ void w4_dequant_kernel(const uint4* __restrict__ qweight, const T* __restrict__ scales,
                                  const int16_t* __restrict__ zeros, T* __restrict__ w, int n,
                                  int k, int num_groups, int group_size, int zero_value) {
  const int num_chunks = (k + kChunkK - 1) / kChunkK;
  const size_t idx = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int num_tiles = (n + kTileN - 1) / kTileN;
  if (idx >= static_cast<size_t>(num_tiles) * num_chunks * 32) return;
  const int lane = idx % 32;
  const int c = (idx / 32) % num_chunks;
  const int tile = idx / 32 / num_chunks;
  const int g = lane / 4, t = lane % 4;
  const uint4 v = qweight[idx];
  const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int s = 0; s < 2; ++s) {
    const int k0 = c * kChunkK + 32 * s + 8 * t;
    if (k0 >= k) continue;  // K is a multiple of 8: the 8 rows are all in or all out
    const int grp = min(k0 / group_size, num_groups - 1);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int col = tile * kTileN + 8 * h + g;
      if (col >= n) continue;
      const size_t gi = static_cast<size_t>(grp) * n + col;
      const float z = HAS_ZEROS ? static_cast<float>(zeros[gi]) : static_cast<float>(zero_value);
      const float sc = to_float(scales[gi]);
      const uint32_t word = words[2 * s + h];
      alignas(16) T vals[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) {  // K offset i sits at nibble position i / 2 + 4 (i % 2)
        const int q = (word >> (4 * (i / 2 + 4 * (i % 2)))) & 0xF;
        vals[i] = from_float<T>((static_cast<float>(q) - z) * sc);
      }
      *reinterpret_cast<uint4*>(w + static_cast<size_t>(col) * k + k0) =
          *reinterpret_cast<const uint4*>(vals);
    }
  }
}

}  // namespace w4

#ifndef W4_NO_TORCH

template <typename T, bool HAS_ZEROS, int WARPS, int MT, int NT, int KW>
static void launch_gemm(const torch::Tensor& x, const torch::Tensor& qweight,
                        const torch::Tensor& scales, const std::optional<torch::Tensor>& zeros,
                        const std::optional<torch::Tensor>& bias, torch::Tensor& out,
                        int group_size, int zero_value, int split) {
  const int m = x.size(0), k = x.size(1), n = out.size(1);
  const int num_tiles = (n + w4::kTileN - 1) / w4::kTileN;
  const int num_chunks = (k + w4::kChunkK - 1) / w4::kChunkK;
  const int chunks_per_split = (num_chunks + split - 1) / split;
  split = (num_chunks + chunks_per_split - 1) / chunks_per_split;  // no empty split
  const int cols_per_block = WARPS * NT;
  dim3 grid((num_tiles + cols_per_block - 1) / cols_per_block, split, (m + MT * 16 - 1) / (MT * 16));
  auto stream = at::cuda::getCurrentCUDAStream();
  const T* xp = reinterpret_cast<const T*>(x.data_ptr());
  const uint4* wp = reinterpret_cast<const uint4*>(qweight.data_ptr());
  const T* sp = reinterpret_cast<const T*>(scales.data_ptr());
  const int16_t* zp = HAS_ZEROS ? reinterpret_cast<const int16_t*>(zeros->data_ptr()) : nullptr;
  const T* bp = bias.has_value() ? reinterpret_cast<const T*>(bias->data_ptr()) : nullptr;
  T* op = reinterpret_cast<T*>(out.data_ptr());
  const size_t smem =
      sizeof(uint4) * KW * w4::kStages * w4::GemmStage<MT, NT>::size(WARPS, HAS_ZEROS);
  auto kernel = w4::w4_gemm_kernel<T, HAS_ZEROS, WARPS, MT, NT, KW>;
  // Function attributes are per device: set once for each device this instantiation runs on
  // (a race sets them twice, harmlessly).
  static uint64_t attributes_set = 0;
  const int device = x.get_device();
  if (device >= 64 || !((attributes_set >> device) & 1)) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(smem)));
    // all of the unified L1 / shared memory as shared memory: more blocks per SM
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                        cudaSharedmemCarveoutMaxShared));
    if (device < 64) attributes_set |= uint64_t{1} << device;
  }
  if (split == 1) {
    kernel<<<grid, WARPS * KW * 32, smem, stream>>>(
        xp, wp, sp, zp, bp, op, nullptr, m, n, k, scales.size(0), 1.0f / group_size, zero_value,
        chunks_per_split);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  auto partial = torch::empty({split, m, n}, x.options().dtype(torch::kFloat32));
  kernel<<<grid, WARPS * KW * 32, smem, stream>>>(
      xp, wp, sp, zp, nullptr, nullptr, partial.data_ptr<float>(), m, n, k, scales.size(0),
      1.0f / group_size, zero_value, chunks_per_split);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const int mn = m * n;
  w4::w4_sum_partials<T><<<(mn + 255) / 256, 256, 0, stream>>>(partial.data_ptr<float>(), bp, op,
                                                               mn, n, split);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Launches the built instantiation for (num_warps, mt, nt, kw); false if there is none
// (w4_gemm_out returns it: see w4_gemv_out).
template <typename T, bool HAS_ZEROS>
static bool dispatch_gemm(const torch::Tensor& x, const torch::Tensor& qweight,
                          const torch::Tensor& scales, const std::optional<torch::Tensor>& zeros,
                          const std::optional<torch::Tensor>& bias, torch::Tensor& out,
                          int group_size, int zero_value, int num_warps, int split, int mt,
                          int nt, int kw) {
#define W4_GEMM_CASE(WARPS, MT, NT, KW)                                                       \
  if (num_warps == WARPS && mt == MT && nt == NT && kw == KW) {                               \
    launch_gemm<T, HAS_ZEROS, WARPS, MT, NT, KW>(x, qweight, scales, zeros, bias, out,          \
                                                 group_size, zero_value, split);                \
    return true;                                                                              \
  }
  // w4_gemv_cuda.GEMM_CONFIGS: keep the two lists equal
  W4_GEMM_CASE(8, 1, 1, 1) W4_GEMM_CASE(4, 1, 2, 1) W4_GEMM_CASE(4, 2, 2, 1)
  W4_GEMM_CASE(8, 2, 1, 1) W4_GEMM_CASE(4, 4, 1, 1) W4_GEMM_CASE(8, 4, 1, 1)
  W4_GEMM_CASE(4, 4, 2, 1) W4_GEMM_CASE(8, 4, 2, 1)
  W4_GEMM_CASE(8, 1, 1, 2) W4_GEMM_CASE(4, 1, 2, 2) W4_GEMM_CASE(4, 4, 1, 2)
  W4_GEMM_CASE(8, 4, 1, 2) W4_GEMM_CASE(8, 4, 2, 2)
#undef W4_GEMM_CASE
  return false;
}

// out [M, N] = x [M, K] @ W^T (+ bias); scales in x's dtype; the caller checks shapes.
bool w4_gemm_out(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales,
                 std::optional<torch::Tensor> zeros, std::optional<torch::Tensor> bias,
                 torch::Tensor out, int64_t group_size, int64_t zero_value, int64_t num_warps,
                 int64_t split, int64_t mt, int64_t nt, int64_t kw) {
  TORCH_CHECK(split >= 1, "w4_gemm: bad split");
  TORCH_CHECK(scales.scalar_type() == x.scalar_type(), "w4_gemm: scales must be in x's dtype");
  TORCH_CHECK(out.size(1) % 8 == 0 && x.size(1) % 8 == 0, "w4_gemm: N and K must be multiples of 8");
  TORCH_CHECK(x.size(1) < w4::kMaxK, "w4_gemm: K must be below 2^21 (group_of), got ", x.size(1));
  for (const torch::Tensor* p : {&x, &scales}) {  // 16-byte cp.async
    TORCH_CHECK(reinterpret_cast<uintptr_t>(p->data_ptr()) % 16 == 0, "w4_gemm: unaligned input");
  }
  TORCH_CHECK(!zeros.has_value() || reinterpret_cast<uintptr_t>(zeros->data_ptr()) % 16 == 0,
              "w4_gemm: unaligned zeros");
  const bool z = zeros.has_value();
  // false: not built, nothing launched (the caller raises: see w4_gemv_out)
  if (x.scalar_type() == at::kHalf) {
    return z ? dispatch_gemm<__half, true>(x, qweight, scales, zeros, bias, out, group_size,
                                           zero_value, num_warps, split, mt, nt, kw)
             : dispatch_gemm<__half, false>(x, qweight, scales, zeros, bias, out, group_size,
                                            zero_value, num_warps, split, mt, nt, kw);
  }
  return z ? dispatch_gemm<__nv_bfloat16, true>(x, qweight, scales, zeros, bias, out, group_size,
                                                zero_value, num_warps, split, mt, nt, kw)
           : dispatch_gemm<__nv_bfloat16, false>(x, qweight, scales, zeros, bias, out, group_size,
                                                 zero_value, num_warps, split, mt, nt, kw);
}

// W [N, K] (out) in scales' dtype from the repacked weight.
void w4_dequant_out(torch::Tensor qweight, torch::Tensor scales,
                    std::optional<torch::Tensor> zeros, torch::Tensor out, int64_t group_size,
                    int64_t zero_value) {
  TORCH_CHECK(scales.scalar_type() == out.scalar_type(), "w4_dequant: dtype mismatch");
  const int n = out.size(0), k = out.size(1);
  const int num_tiles = (n + w4::kTileN - 1) / w4::kTileN;
  const int num_chunks = (k + w4::kChunkK - 1) / w4::kChunkK;
  const size_t threads = static_cast<size_t>(num_tiles) * num_chunks * 32;
  const int blocks = static_cast<int>((threads + 255) / 256);
  auto stream = at::cuda::getCurrentCUDAStream();
  const bool z = zeros.has_value();
  const int16_t* zp = z ? reinterpret_cast<const int16_t*>(zeros->data_ptr()) : nullptr;
  const uint4* wp = reinterpret_cast<const uint4*>(qweight.data_ptr());
#define W4_DQ(T, Z)                                                                          \
  w4::w4_dequant_kernel<T, Z><<<blocks, 256, 0, stream>>>(                                   \
      wp, reinterpret_cast<const T*>(scales.data_ptr()), zp,                                 \
      reinterpret_cast<T*>(out.data_ptr()), n, k, scales.size(0), group_size, zero_value)
  if (out.scalar_type() == at::kHalf) {
    if (z) W4_DQ(__half, true); else W4_DQ(__half, false);
  } else {
    if (z) W4_DQ(__nv_bfloat16, true); else W4_DQ(__nv_bfloat16, false);
  }
#undef W4_DQ
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
#endif  // W4_NO_TORCH
