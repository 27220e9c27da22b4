// W4A16 GEMM for 9..GEMM_MAX_M rows of x on tensor cores, and the dequantization of the
// repacked weight for larger M (then cuBLAS), both reading the layout of w4_gemv.cu (whose
// helpers this file uses: load_inline compiles the two sources as one unit, w4_gemv.cu first).
//
// The GEMM swaps the MMA's operands against the GEMV: x is the A operand (16 rows of x per
// m16n8k16 MMA) and the weight the B operand (8 columns), so that one dequantized weight
// fragment serves every row of x in the block. A lane's uint4 of a chunk (words {step 0 col g,
// step 0 col g + 8, step 1 col g, step 1 col g + 8}) is exactly its B fragments of the chunk's
// eight MMAs per 16 rows: word 2 s + h, dequantized to the pairs (K offsets 0 1) (2 3) (4 5)
// (6 7), is b0 b1 of the step's first k16 MMA and b0 b1 of its second. The A fragment of rows
// g and g + 8 is one 16-byte load of x per row, x[row, 32 s + 8 t .. + 7], in the same K order.
// The group scale multiplies the dequantized q - z in x's dtype (scales are in x's dtype), so
// each weight is (q - z) * s rounded once, as the reference `dequantize(w, dtype)` rounds it.
//
// Work split: a block's WARPS warps each own NT 16-column tiles (block: 16 NT WARPS columns),
// all rows of an MT x 16 row block (grid z), and one K range (grid y: split-K). With split-K
// each block writes fp32 partial sums that w4_sum_partials adds (with the bias); else the
// block writes the output. No atomics, no host syncs: CUDA-graph safe.

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

constexpr int kStages = 4;   // chunks in flight per block (cp.async ring)
constexpr int kXPad = 32;    // x row stride 64 + 32 elements (192 B = 64 mod 128: no bank conflict)

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const int bytes = valid ? 16 : 0;  // 0: zero-fill (rows / columns / K past the end)
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Shared memory of one stage (one 64-row K chunk), in 16-byte units.
template <int MT, int NT>
struct GemmStage {
  static constexpr int kRows = MT * 16;
  static __host__ __device__ constexpr int weights(int warps) { return warps * NT * 32; }
  static constexpr int kXRow = (kChunkK + kXPad) * 2 / 16;  // 12
  static constexpr int kX = kRows * kXRow;
  static __host__ __device__ constexpr int params(int warps) {  // scales (and zeros): 2 steps
    return 2 * warps * NT * kTileN * 2 / 16;
  }
  static __host__ __device__ constexpr int size(int warps, bool zeros) {
    return weights(warps) + kX + params(warps) * (zeros ? 2 : 1);
  }
};

template <typename T, bool HAS_ZEROS, int MT, int NT>
__global__ void __launch_bounds__(256, 2) w4_gemm_kernel(
    const T* __restrict__ x,             // [M, K]
    const uint4* __restrict__ qweight,   // [N_pad / 16, K_pad / 64, 32] uint4 (repacked)
    const T* __restrict__ scales,        // [G, N] in x's dtype
    const int16_t* __restrict__ zeros,   // [G, N] (HAS_ZEROS)
    const T* __restrict__ bias,          // [N] or nullptr (no split-K)
    T* __restrict__ out,                 // [M, N] (no split-K)
    float* __restrict__ partial,         // [split, M, N] or nullptr
    int m, int n, int k, int num_groups, int group_size, int zero_value, int chunks_per_split) {
  using T2 = typename Dequant<T>::T2;
  using Stage = GemmStage<MT, NT>;
  extern __shared__ uint4 smem[];
  const int warps = blockDim.x / 32;
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int g = lane / 4;
  const int t = lane % 4;
  const int block_cols = warps * NT * kTileN;
  const int col_base = blockIdx.x * block_cols;   // the block's first output column
  const int num_tiles = (n + kTileN - 1) / kTileN;
  const int num_chunks = (k + kChunkK - 1) / kChunkK;
  const int c_begin = blockIdx.y * chunks_per_split;
  const int c_end = min(c_begin + chunks_per_split, num_chunks);
  const int row0 = blockIdx.z * Stage::kRows;
  const int stage_size = Stage::size(warps, HAS_ZEROS);
  const int w_units = Stage::weights(warps), p_units = Stage::params(warps);

  // Issue the cp.async copies of chunk c into ring slot `slot` (every thread takes a share).
  auto load_chunk = [&](int c, int slot) {
    uint4* st = smem + slot * stage_size;
    for (int i = threadIdx.x; i < w_units; i += blockDim.x) {  // [warp][tile][lane]
      const int tile = col_base / kTileN + i / 32;
      const bool ok = tile < num_tiles;
      const uint4* src = qweight + (static_cast<size_t>(ok ? tile : 0) * num_chunks + c) * 32 + i % 32;
      cp_async16(st + i, src, ok);
    }
    uint4* sx = st + w_units;
    for (int i = threadIdx.x; i < Stage::kRows * 8; i += blockDim.x) {  // [row][8 pieces of 8 K]
      const int r = i / 8, piece = i % 8;
      const int row = row0 + r, kk = c * kChunkK + piece * 8;
      const bool ok = row < m && kk < k;
      const T* src = x + (ok ? static_cast<size_t>(row) * k + kk : 0);
      cp_async16(sx + r * Stage::kXRow + piece, src, ok);
    }
    uint4* sp = sx + Stage::kX;
    for (int i = threadIdx.x; i < p_units * (HAS_ZEROS ? 2 : 1); i += blockDim.x) {
      const int which = i / p_units, j = i % p_units;      // scales, then zeros
      const int step = j / (p_units / 2), piece = j % (p_units / 2);
      const int col = col_base + piece * 8;
      const int grp = min((c * kChunkK + 32 * step) / group_size, num_groups - 1);
      const bool ok = col < n;
      const size_t off = ok ? static_cast<size_t>(grp) * n + col : 0;
      const void* src = which == 0 ? static_cast<const void*>(scales + off)
                                   : static_cast<const void*>(zeros + off);
      cp_async16(sp + i, src, ok);
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

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (c_begin + s < c_end) load_chunk(c_begin + s, s);
    cp_async_commit();
  }
  for (int c = c_begin; c < c_end; ++c) {
    cp_async_wait<kStages - 2>();
    __syncthreads();  // chunk c landed for every thread; slot (c - 1) is free again
    if (c + kStages - 1 < c_end) load_chunk(c + kStages - 1, (c - c_begin + kStages - 1) % kStages);
    cp_async_commit();
    const uint4* st = smem + ((c - c_begin) % kStages) * stage_size;
    const uint4* sx = st + w_units;
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
        const uint4 x0 = sx[(16 * i + g) * Stage::kXRow + 4 * s + t];
        const uint4 x1 = sx[(16 * i + g + 8) * Stage::kXRow + 4 * s + t];
        const uint32_t a_lo[4] = {x0.x, x1.x, x0.y, x1.y};
        const uint32_t a_hi[4] = {x0.z, x1.z, x0.w, x1.w};
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

template <typename T, bool HAS_ZEROS, int MT, int NT>
static void launch_gemm(const torch::Tensor& x, const torch::Tensor& qweight,
                        const torch::Tensor& scales, const std::optional<torch::Tensor>& zeros,
                        const std::optional<torch::Tensor>& bias, torch::Tensor& out,
                        int group_size, int zero_value, int num_warps, int split) {
  const int m = x.size(0), k = x.size(1), n = out.size(1);
  const int num_tiles = (n + w4::kTileN - 1) / w4::kTileN;
  const int num_chunks = (k + w4::kChunkK - 1) / w4::kChunkK;
  const int chunks_per_split = (num_chunks + split - 1) / split;
  split = (num_chunks + chunks_per_split - 1) / chunks_per_split;  // no empty split
  const int cols_per_block = num_warps * NT;
  dim3 grid((num_tiles + cols_per_block - 1) / cols_per_block, split, (m + MT * 16 - 1) / (MT * 16));
  auto stream = at::cuda::getCurrentCUDAStream();
  const T* xp = reinterpret_cast<const T*>(x.data_ptr());
  const uint4* wp = reinterpret_cast<const uint4*>(qweight.data_ptr());
  const T* sp = reinterpret_cast<const T*>(scales.data_ptr());
  const int16_t* zp = HAS_ZEROS ? reinterpret_cast<const int16_t*>(zeros->data_ptr()) : nullptr;
  const T* bp = bias.has_value() ? reinterpret_cast<const T*>(bias->data_ptr()) : nullptr;
  T* op = reinterpret_cast<T*>(out.data_ptr());
  const size_t smem = sizeof(uint4) * w4::kStages * w4::GemmStage<MT, NT>::size(num_warps, HAS_ZEROS);
  auto kernel = w4::w4_gemm_kernel<T, HAS_ZEROS, MT, NT>;
  static bool smem_set = false;  // once per instantiation, for the largest block (8 warps)
  if (!smem_set) {
    const size_t most = sizeof(uint4) * w4::kStages * w4::GemmStage<MT, NT>::size(8, HAS_ZEROS);
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(most)));
    // all of the unified L1 / shared memory as shared memory: more blocks per SM
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                        cudaSharedmemCarveoutMaxShared));
    smem_set = true;
  }
  if (split == 1) {
    kernel<<<grid, num_warps * 32, smem, stream>>>(
        xp, wp, sp, zp, bp, op, nullptr, m, n, k, scales.size(0), group_size, zero_value,
        chunks_per_split);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  auto partial = torch::empty({split, m, n}, x.options().dtype(torch::kFloat32));
  kernel<<<grid, num_warps * 32, smem, stream>>>(
      xp, wp, sp, zp, nullptr, nullptr, partial.data_ptr<float>(), m, n, k, scales.size(0),
      group_size, zero_value, chunks_per_split);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const int mn = m * n;
  w4::w4_sum_partials<T><<<(mn + 255) / 256, 256, 0, stream>>>(partial.data_ptr<float>(), bp, op,
                                                               mn, n, split);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T, bool HAS_ZEROS>
static void dispatch_gemm(const torch::Tensor& x, const torch::Tensor& qweight,
                          const torch::Tensor& scales, const std::optional<torch::Tensor>& zeros,
                          const std::optional<torch::Tensor>& bias, torch::Tensor& out,
                          int group_size, int zero_value, int num_warps, int split, int mt,
                          int nt) {
#define W4_GEMM_CASE(MT, NT)                                                                 \
  if (mt == MT && nt == NT)                                                                  \
    return launch_gemm<T, HAS_ZEROS, MT, NT>(x, qweight, scales, zeros, bias, out, group_size, \
                                             zero_value, num_warps, split);
  W4_GEMM_CASE(1, 1) W4_GEMM_CASE(2, 1) W4_GEMM_CASE(4, 1)
  W4_GEMM_CASE(1, 2) W4_GEMM_CASE(2, 2) W4_GEMM_CASE(4, 2)
#undef W4_GEMM_CASE
  TORCH_CHECK(false, "w4_gemm: (mt, nt) must be in {1, 2, 4} x {1, 2}, got ", mt, ", ", nt);
}

// out [M, N] = x [M, K] @ W^T (+ bias); scales in x's dtype; the caller checks shapes.
void w4_gemm_out(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales,
                 std::optional<torch::Tensor> zeros, std::optional<torch::Tensor> bias,
                 torch::Tensor out, int64_t group_size, int64_t zero_value, int64_t num_warps,
                 int64_t split, int64_t mt, int64_t nt) {
  TORCH_CHECK(num_warps >= 1 && num_warps <= 8 && split >= 1, "w4_gemm: bad warps/split");
  TORCH_CHECK(scales.scalar_type() == x.scalar_type(), "w4_gemm: scales must be in x's dtype");
  TORCH_CHECK(out.size(1) % 8 == 0 && x.size(1) % 8 == 0, "w4_gemm: N and K must be multiples of 8");
  for (const torch::Tensor* p : {&x, &scales}) {  // 16-byte cp.async
    TORCH_CHECK(reinterpret_cast<uintptr_t>(p->data_ptr()) % 16 == 0, "w4_gemm: unaligned input");
  }
  TORCH_CHECK(!zeros.has_value() || reinterpret_cast<uintptr_t>(zeros->data_ptr()) % 16 == 0,
              "w4_gemm: unaligned zeros");
  const bool z = zeros.has_value();
  if (x.scalar_type() == at::kHalf) {
    if (z) return dispatch_gemm<__half, true>(x, qweight, scales, zeros, bias, out, group_size,
                                              zero_value, num_warps, split, mt, nt);
    return dispatch_gemm<__half, false>(x, qweight, scales, zeros, bias, out, group_size,
                                        zero_value, num_warps, split, mt, nt);
  }
  if (z) return dispatch_gemm<__nv_bfloat16, true>(x, qweight, scales, zeros, bias, out,
                                                   group_size, zero_value, num_warps, split, mt,
                                                   nt);
  return dispatch_gemm<__nv_bfloat16, false>(x, qweight, scales, zeros, bias, out, group_size,
                                              zero_value, num_warps, split, mt, nt);
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
