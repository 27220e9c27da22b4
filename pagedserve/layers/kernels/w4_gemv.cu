// W4A16 GEMV for decode (M = 1..8 rows of x) on tensor cores: y = x @ W^T (+ bias).
// Built by w4_gemv_cuda.py (torch.utils.cpp_extension.load_inline); the layout of the repacked
// weight and the numerics are described there.
//
// One block owns NT x 16 output columns (NT "tiles") and its warps split the K range:
// warp w takes the 64-row chunks w, w + W, w + 2W, ... (W warps), so that the warps of a block
// stream adjacent 512-byte pieces of a tile. Per chunk each lane loads one uint4 of weights per
// tile (its A fragments of four m16n8k16 MMAs) and two uint4 of x (its B fragments), dequantizes the
// words with lop3 into fp16x2 / bf16x2 values q - z (exact), and the tensor cores accumulate
// x * (q - z) in fp32. The group's scale multiplies the chunk's fp32 sum once. The warps' sums
// meet in shared memory at the end; no split-K across blocks, no second kernel, no atomics.
//
// Fused epilogues (EPI != kEpiNone, two tiles per block): the block's two tiles are partners, so
// that it can finish the output pairwise: silu(gate) * up of a [gate | up] layer, or the rotary
// embedding of a qkv layer's q and k heads (see Epilogue).

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>

namespace w4 {

constexpr int kTileN = 16;      // output columns of a block (the MMA's M)
constexpr int kChunkK = 64;     // K rows of one lane's uint4 (two k32 steps)
constexpr int kMaxM = 8;        // the MMA's N: rows of x
constexpr int kMaxK = 1 << 21;  // group_of is exact below this (w4_gemv_cuda.MAX_K)

// What the GEMV does with its sums before it stores them (w4_gemv_cuda's GemvEpilogue).
constexpr int kEpiNone = 0;     // out [M, N] = x @ W^T (+ bias)
constexpr int kEpiSiluMul = 1;  // W's N columns are [gate | up]: out [M, N / 2] = silu(gate) * up
constexpr int kEpiRope = 2;     // out [M, N], the q and k heads rotated (neox layout)

// A paired-tile epilogue's parameters. Block b owns the tiles t0 = (b / P) 2P + b % P and t0 + P
// (P = `period`), so that output column c of t0 meets its partner c + 16 P in one block:
// kEpiSiluMul: P = N / 32 (gate column c, up column c + N / 2). kEpiRope: P = half / 16 (column
// d < half of a head and its rotation partner d + half). Each sum is rounded to T first, as the
// unfused GEMV's output is, then the epilogue runs in fp32 and rounds once more.
struct Epilogue {
  const int64_t* positions;  // [M] token positions (kEpiRope)
  const float* cos_sin;      // [max_position, 2 half] fp32, [cos | sin] per row (kEpiRope)
  int64_t cos_sin_stride;    // elements between rows of cos_sin
  int period;                // P, in tiles
  int rot_cols;              // columns of the rotated heads, q then k (kEpiRope): the rest is v
  int half;                  // half a head's columns (kEpiRope)
};

// Programmatic dependent launch (sm_90+; PTX griddepcontrol). A kernel launched with the
// programmatic-serialization attribute may start while the kernel before it in the stream still
// runs: it must call gdc_wait() before reading anything a kernel may write (x, and the bias,
// which the caller may have just cast) and before writing anything (out), and may read only
// what no kernel writes (the weights, scales and zeros) before it. gdc_launch_dependents() lets
// the next such kernel start early. Both are no-ops in a kernel launched without the
// attribute, and below sm_90 they compile to nothing.
__device__ __forceinline__ void gdc_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void gdc_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

__device__ __forceinline__ uint32_t lop3_and_or(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;  // (a & b) | c in one instruction
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

__device__ __forceinline__ uint32_t as_u32(__half2 v) { return *reinterpret_cast<uint32_t*>(&v); }
__device__ __forceinline__ uint32_t as_u32(__nv_bfloat162 v) {
  return *reinterpret_cast<uint32_t*>(&v);
}
template <typename T2>
__device__ __forceinline__ T2 from_u32(uint32_t v) {
  return *reinterpret_cast<T2*>(&v);
}

// A word holds the K offsets 0..7 of one column at nibble positions 0 4 1 5 2 6 3 7 (repack),
// so each masked half-word pair is two consecutive K rows: (k0, k1), (k2, k3), (k4, k5), (k6, k7).
template <typename T>
struct Dequant;

template <>
struct Dequant<__half> {
  using T2 = __half2;
  // fp16 1024 + q from bits 0-3 of a half (0x6400 = 1024.0, one unit per mantissa step), and
  // 1024 + 16 q from bits 4-7; both exact. Returns the four fp16x2 values q - z.
  __device__ __forceinline__ static void run(uint32_t w, int zero, uint32_t (&out)[4]) {
    const __half2 lo_off = __half2half2(__int2half_rn(1024 + zero));
    const __half2 hi_off = __half2half2(__int2half_rn(-(64 + zero)));
    const __half2 sixteenth = __half2half2(__float2half_rn(0.0625f));
    const uint32_t w8 = w >> 8;
    out[0] = as_u32(__hsub2(from_u32<__half2>(lop3_and_or(w, 0x000F000Fu, 0x64006400u)), lo_off));
    out[1] = as_u32(
        __hfma2(from_u32<__half2>(lop3_and_or(w, 0x00F000F0u, 0x64006400u)), sixteenth, hi_off));
    out[2] = as_u32(__hsub2(from_u32<__half2>(lop3_and_or(w8, 0x000F000Fu, 0x64006400u)), lo_off));
    out[3] = as_u32(
        __hfma2(from_u32<__half2>(lop3_and_or(w8, 0x00F000F0u, 0x64006400u)), sixteenth, hi_off));
  }
};

template <>
struct Dequant<__nv_bfloat16> {
  using T2 = __nv_bfloat162;
  // bf16 128 + q from bits 0-3 of a half (0x4300 = 128.0: 7 mantissa bits, unit 1); bits 4-7
  // do not fit, hence the shifts. Exact for |z| < 128.
  __device__ __forceinline__ static void run(uint32_t w, int zero, uint32_t (&out)[4]) {
    const __nv_bfloat162 off = __bfloat162bfloat162(__int2bfloat16_rn(128 + zero));
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t v = lop3_and_or(w >> (4 * i), 0x000F000Fu, 0x43004300u);
      out[i] = as_u32(__hsub2(from_u32<__nv_bfloat162>(v), off));
    }
  }
};

template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                          uint32_t b1);

template <>
__device__ __forceinline__ void mma_16816<__half>(float (&d)[4], const uint32_t (&a)[4],
                                                  uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4],
                                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint4 load_stream(const uint4* p) {
  uint4 v;  // read once: keep it out of L1
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

template <typename T>
__device__ __forceinline__ float to_float(T v);
template <>
__device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
// A scale's raw 16 bits as float: fp16 or bf16 (checkpoints keep fp16 scales for bf16 models).
__device__ __forceinline__ float scale_to_float(uint16_t raw, bool bf16) {
  return bf16 ? __uint_as_float(static_cast<uint32_t>(raw) << 16)
              : __half2float(__ushort_as_half(raw));
}
template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// floor(row / group_size) without an integer division: (row + 0.5) * (1 / group_size) in
// fp32 is within 2^-2 / group_size of the exact quotient for row < 2^21 (the host checks K),
// and the quotient is 0.5 / group_size away from the next integer.
__device__ __forceinline__ int group_of(int row, float inv_group, int last_group) {
  return min(__float2int_rz((static_cast<float>(row) + 0.5f) * inv_group), last_group);
}

// Lane layout (m16n8k16 fragments): g = lane / 4 picks the output columns g and g + 8 of a
// tile (A rows) and the row g of x (B column); t = lane % 4 picks the lane's 8 K rows in each
// k32 step: 8 t .. 8 t + 7. Its uint4 of a chunk: {step 0 col g, step 0 col g + 8, step 1 col g,
// step 1 col g + 8}.
//
// STEP_SCALE: groups of 32 rows (a scale per k32 step), else a scale per 64-row chunk
// (group_size a multiple of 64, or a single group).
//
// A block owns NT tiles (NT x 16 columns): a lane's x fragment of a chunk, its address
// arithmetic and the loop serve NT tiles' MMAs (NT = 2 halves that overhead per weight byte;
// NT = 1 keeps more blocks for narrow layers).
//
// Pipelining: a warp's chunks come in batches of UNROLL, in two register buffers: the loads of
// batch i + 1 (weights, scales, zeros) are issued before the MMAs of batch i, so that a warp
// keeps UNROLL x NT x 16 bytes per lane in flight while it computes. The loads have no
// branches: a chunk past the end re-reads the last chunk (an L2 hit) and its sum is dropped.
template <bool STEP_SCALE, int UNROLL, int NT>
struct GemvBatch {
  static constexpr int kSteps = STEP_SCALE ? 2 : 1;  // scale / zero rows per chunk
  uint4 w[UNROLL][NT];
  uint16_t s[UNROLL][NT][kSteps][2];  // raw scales of columns g, g + 8
  int16_t z[UNROLL][NT][kSteps][2];
};

template <typename T, bool HAS_ZEROS, bool STEP_SCALE, int UNROLL, int NT, int EPI>
__global__ void __launch_bounds__(512, 1) w4_gemv_kernel(
    const T* __restrict__ x,              // [M, K]
    const uint4* __restrict__ qweight,    // [N_pad / 16, K_pad / 64, 32] uint4 (repacked)
    const uint16_t* __restrict__ scales,  // [G, N] fp16 or bf16 (scales_bf16)
    const int16_t* __restrict__ zeros,    // [G, N] (HAS_ZEROS)
    const T* __restrict__ bias,           // [N] or nullptr
    T* __restrict__ out,                  // [M, N] ([M, N / 2]: kEpiSiluMul)
    int m, int n, int k, int num_groups, float inv_group, int zero_value, bool scales_bf16,
    Epilogue epi) {
  static_assert(EPI == kEpiNone || NT == 2, "a paired-tile epilogue needs two tiles per block");
  using Batch = GemvBatch<STEP_SCALE, UNROLL, NT>;
  constexpr int kSteps = Batch::kSteps;
  constexpr int kCols = NT * kTileN;
  extern __shared__ float partial[];  // [num_warps][kMaxM][kCols]
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int num_warps = blockDim.x / 32;
  const int g = lane / 4;
  const int t = lane % 4;
  const int num_tiles = (n + kTileN - 1) / kTileN;
  const int num_chunks = (k + kChunkK - 1) / kChunkK;
  const int last_chunk = num_chunks - 1;
  const int stride = num_warps * UNROLL;
  // The block's first tile and the step to its next: adjacent tiles, or partners P apart.
  const int period = EPI == kEpiNone ? 1 : epi.period;
  const int tile0 = EPI == kEpiNone
                        ? blockIdx.x * NT
                        : (blockIdx.x / period) * 2 * period + blockIdx.x % period;
  const uint4* wtile[NT];
  int col0[NT], col1[NT];  // clamped: padded columns read column n - 1
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const int tile = min(tile0 + j * period, num_tiles - 1);  // a missing last tile: dropped
    wtile[j] = qweight + static_cast<size_t>(tile) * num_chunks * 32 + lane;
    col0[j] = min(tile * kTileN + g, n - 1);
    col1[j] = min(tile * kTileN + g + 8, n - 1);
  }
  const T* xrow = x + static_cast<size_t>(g) * k + 8 * t;
  const bool has_row = g < m;

  auto load_batch = [&](Batch& b, int c_base) {
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int c = min(c_base + u * num_warps, last_chunk);
#pragma unroll
      for (int j = 0; j < NT; ++j) b.w[u][j] = load_stream(wtile[j] + static_cast<size_t>(c) * 32);
#pragma unroll
      for (int st = 0; st < kSteps; ++st) {
        const int grp = group_of(c * kChunkK + st * 32, inv_group, num_groups - 1);
        const uint16_t* srow = scales + static_cast<size_t>(grp) * n;
        const int16_t* zrow = zeros + static_cast<size_t>(grp) * n;
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          b.s[u][j][st][0] = __ldg(srow + col0[j]);
          b.s[u][j][st][1] = __ldg(srow + col1[j]);
          if (HAS_ZEROS) {
            b.z[u][j][st][0] = __ldg(zrow + col0[j]);
            b.z[u][j][st][1] = __ldg(zrow + col1[j]);
          }
        }
      }
    }
  };

  float acc[NT][4] = {};  // per tile: (col g, row 2t), (col g, 2t+1), (g+8, 2t), (g+8, 2t+1)
  auto compute_batch = [&](const Batch& b, int c_base) {
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int c = c_base + u * num_warps;
      const bool valid = c < num_chunks;  // warp-uniform
      const int cc = min(c, last_chunk);
      // x is small and read by every block: an L1 / L2 hit. A coherent load (ld.global.ca),
      // not the non-coherent path: with programmatic launch the previous kernel writes x while
      // this kernel runs (before gdc_wait), which ld.global.nc's "read-only for the kernel's
      // life" forbids. Explicit: a plain *xp through `const T* __restrict__` compiles to
      // ld.global.nc, an invariant load the compiler may even move above gdc_wait.
      uint4 xv[2];
#pragma unroll
      for (int st = 0; st < 2; ++st) {
        const int k0 = cc * kChunkK + st * 32 + 8 * t;
        const uint4* xp = reinterpret_cast<const uint4*>(xrow + cc * kChunkK + st * 32);
        xv[st] = (has_row && k0 < k) ? __ldca(xp) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const uint32_t words[4] = {b.w[u][j].x, b.w[u][j].y, b.w[u][j].z, b.w[u][j].w};
        float part[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int st = 0; st < 2; ++st) {
          const int gs = STEP_SCALE ? st : 0;
          const int z0 = HAS_ZEROS ? b.z[u][j][gs][0] : zero_value;
          const int z1 = HAS_ZEROS ? b.z[u][j][gs][1] : zero_value;
          uint32_t a0[4], a1[4];  // columns g and g + 8: (k0,k1) (k2,k3) (k4,k5) (k6,k7)
          Dequant<T>::run(words[2 * st], z0, a0);
          Dequant<T>::run(words[2 * st + 1], z1, a1);
          const uint32_t frag_lo[4] = {a0[0], a1[0], a0[1], a1[1]};
          const uint32_t frag_hi[4] = {a0[2], a1[2], a0[3], a1[3]};
          mma_16816<T>(part, frag_lo, xv[st].x, xv[st].y);
          mma_16816<T>(part, frag_hi, xv[st].z, xv[st].w);
          if (STEP_SCALE || st == 1) {
            const float s0 = scale_to_float(b.s[u][j][gs][0], scales_bf16);
            const float s1 = scale_to_float(b.s[u][j][gs][1], scales_bf16);
            if (valid) {
              acc[j][0] = fmaf(part[0], s0, acc[j][0]);
              acc[j][1] = fmaf(part[1], s0, acc[j][1]);
              acc[j][2] = fmaf(part[2], s1, acc[j][2]);
              acc[j][3] = fmaf(part[3], s1, acc[j][3]);
            }
            part[0] = part[1] = part[2] = part[3] = 0.f;
          }
        }
      }
    }
  };

  Batch b0, b1;
  load_batch(b0, warp);  // weights and scales only: written by no kernel
  gdc_wait();            // x (read by compute_batch) is the previous kernel's output
  for (int c_base = warp; c_base < num_chunks; c_base += 2 * stride) {
    if (c_base + stride < num_chunks) load_batch(b1, c_base + stride);  // warp-uniform
    compute_batch(b0, c_base);
    if (c_base + stride >= num_chunks) break;
    if (c_base + 2 * stride < num_chunks) load_batch(b0, c_base + 2 * stride);
    compute_batch(b1, c_base + stride);
  }

  gdc_launch_dependents();  // the next kernel may prefetch its weights while this one ends

  // The warps' sums -> shared memory [warp][row of x][column], then one thread per output.
  float* mine = partial + warp * kMaxM * kCols;
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    mine[(2 * t) * kCols + j * kTileN + g] = acc[j][0];
    mine[(2 * t + 1) * kCols + j * kTileN + g] = acc[j][1];
    mine[(2 * t) * kCols + j * kTileN + g + 8] = acc[j][2];
    mine[(2 * t + 1) * kCols + j * kTileN + g + 8] = acc[j][3];
  }
  __syncthreads();
  if constexpr (EPI == kEpiNone) {
    for (int i = threadIdx.x; i < kMaxM * kCols; i += blockDim.x) {  // blocks of 1..4 warps too
      const int row = i / kCols;
      const int col = blockIdx.x * kCols + i % kCols;
      if (row < m && col < n) {
        float sum = 0.f;
        for (int w = 0; w < num_warps; ++w) sum += partial[w * kMaxM * kCols + i];
        if (bias != nullptr) sum += to_float(__ldca(bias + col));  // after gdc_wait, coherent
        out[static_cast<size_t>(row) * n + col] = from_float<T>(sum);
      }
    }
  } else {
    // One thread per (row, column c of the first tile): the column and its partner.
    for (int i = threadIdx.x; i < kMaxM * kTileN; i += blockDim.x) {
      const int row = i / kTileN;
      const int c = i % kTileN;
      if (row >= m) continue;
      float lo = 0.f, hi = 0.f;
      for (int w = 0; w < num_warps; ++w) {
        lo += partial[w * kMaxM * kCols + row * kCols + c];
        hi += partial[w * kMaxM * kCols + row * kCols + kTileN + c];
      }
      const int col_lo = tile0 * kTileN + c;
      const int col_hi = col_lo + period * kTileN;
      if (bias != nullptr) {
        lo += to_float(__ldca(bias + col_lo));
        hi += to_float(__ldca(bias + col_hi));
      }
      const float a = to_float(from_float<T>(lo));  // the unfused output's rounding
      const float b = to_float(from_float<T>(hi));
      if constexpr (EPI == kEpiSiluMul) {
        out[static_cast<size_t>(row) * (n / 2) + col_lo] = from_float<T>(a / (1.f + __expf(-a)) * b);
      } else {
        float o1 = a, o2 = b;
        if (col_lo < epi.rot_cols) {  // a q or k head: rotate (d, d + half) by its position
          const int d = col_lo % (2 * epi.half);
          const float* cs = epi.cos_sin + __ldca(epi.positions + row) * epi.cos_sin_stride;
          const float cosv = __ldg(cs + d);
          const float sinv = __ldg(cs + epi.half + d);
          o1 = a * cosv - b * sinv;
          o2 = b * cosv + a * sinv;
        }
        out[static_cast<size_t>(row) * n + col_lo] = from_float<T>(o1);
        out[static_cast<size_t>(row) * n + col_hi] = from_float<T>(o2);
      }
    }
  }
}

}  // namespace w4

#ifndef W4_NO_TORCH
#include <ATen/cuda/CUDAContext.h>
#include <torch/extension.h>

// kernel<<<grid, block, smem, stream>>>(args...), with programmatic dependent launch when `pdl`
// (the kernel then starts before the previous kernel in the stream has finished and waits in
// gdc_wait: see there). CUDA 12+; stream capture records the programmatic edge in the graph.
template <typename... Params, typename... Args>
static void launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                          cudaStream_t stream, bool pdl, Args... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = pdl ? 1 : 0;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, static_cast<Params>(args)...));
}

template <typename T, bool HAS_ZEROS, bool STEP_SCALE, int UNROLL, int NT, int EPI>
static void launch(const torch::Tensor& x, const torch::Tensor& qweight,
                   const torch::Tensor& scales, const std::optional<torch::Tensor>& zeros,
                   const std::optional<torch::Tensor>& bias, torch::Tensor& out, int group_size,
                   int zero_value, int num_warps, bool pdl, const w4::Epilogue& epi) {
  const int m = x.size(0), k = x.size(1);
  const int n = EPI == w4::kEpiSiluMul ? 2 * out.size(1) : out.size(1);  // W's columns
  const int num_tiles = (n + w4::kTileN - 1) / w4::kTileN;
  const size_t smem = sizeof(float) * num_warps * w4::kMaxM * w4::kTileN * NT;
  auto stream = at::cuda::getCurrentCUDAStream();
  launch_kernel(w4::w4_gemv_kernel<T, HAS_ZEROS, STEP_SCALE, UNROLL, NT, EPI>,
                dim3((num_tiles + NT - 1) / NT), dim3(num_warps * 32), smem, stream, pdl,
          reinterpret_cast<const T*>(x.data_ptr()),
          reinterpret_cast<const uint4*>(qweight.data_ptr()),
          reinterpret_cast<const uint16_t*>(scales.data_ptr()),
          HAS_ZEROS ? reinterpret_cast<const int16_t*>(zeros->data_ptr()) : nullptr,
          bias.has_value() ? reinterpret_cast<const T*>(bias->data_ptr()) : nullptr,
          reinterpret_cast<T*>(out.data_ptr()), m, n, k, scales.size(0), 1.0f / group_size,
          zero_value, scales.scalar_type() == at::kBFloat16, epi);
}

// Launches the built instantiation for (unroll, nt, epi.kind); false if there is none
// (w4_gemv_out returns it: see there).
template <typename T>
static bool dispatch(const torch::Tensor& x, const torch::Tensor& qweight,
                     const torch::Tensor& scales, const std::optional<torch::Tensor>& zeros,
                     const std::optional<torch::Tensor>& bias, torch::Tensor& out, int group_size,
                     int zero_value, int num_warps, int unroll, int nt, bool pdl, int epilogue,
                     const w4::Epilogue& epi) {
  const bool step = group_size % 64 != 0 && scales.size(0) > 1;
  const bool z = zeros.has_value();
#define W4_CASE(Z, S, U, NT, E)                                                               \
  if (z == Z && step == S && unroll == U && nt == NT && epilogue == E) {                      \
    launch<T, Z, S, U, NT, E>(x, qweight, scales, zeros, bias, out, group_size, zero_value,   \
                              num_warps, pdl, epi);                                           \
    return true;                                                                              \
  }
#define W4_CASES(U, NT, E) \
  W4_CASE(false, false, U, NT, E) W4_CASE(false, true, U, NT, E) W4_CASE(true, false, U, NT, E) \
  W4_CASE(true, true, U, NT, E)
  // w4_gemv_cuda.GEMV_CONFIGS and EPILOGUE_CONFIG: keep the lists equal
  W4_CASES(2, 1, w4::kEpiNone) W4_CASES(2, 2, w4::kEpiNone) W4_CASES(4, 1, w4::kEpiNone)
  W4_CASES(2, 2, w4::kEpiSiluMul) W4_CASES(2, 2, w4::kEpiRope)
#undef W4_CASES
#undef W4_CASE
  return false;
}

// out [M, N] = x [M, K] @ W^T (+ bias), or a fused epilogue's output (`epilogue`: w4::kEpi*,
// with `period` and, for kEpiRope, positions [M] int64, cos_sin [*, 2 half] fp32, rot_cols and
// half); the caller checks shapes, dtypes and alignment. Returns false, launching nothing, for
// a configuration it does not build: the caller raises (a c10::Error thrown after the
// dispatch's launches segfaulted the process on the H200, sessions 6 and 7, so this path
// returns instead of throwing).
bool w4_gemv_out(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales,
                 std::optional<torch::Tensor> zeros, std::optional<torch::Tensor> bias,
                 torch::Tensor out, int64_t group_size, int64_t zero_value, int64_t num_warps,
                 int64_t unroll, int64_t nt, bool pdl, int64_t epilogue, int64_t period,
                 std::optional<torch::Tensor> positions, std::optional<torch::Tensor> cos_sin,
                 int64_t rot_cols, int64_t half) {
  TORCH_CHECK(x.size(0) <= w4::kMaxM && num_warps >= 1 && num_warps <= 16, "w4_gemv: bad M/warps");
  TORCH_CHECK(x.size(1) < w4::kMaxK, "w4_gemv: K must be below 2^21 (group_of), got ", x.size(1));
  TORCH_CHECK(epilogue == w4::kEpiNone || period >= 1, "w4_gemv: bad epilogue period");
  TORCH_CHECK(epilogue != w4::kEpiRope || (positions.has_value() && cos_sin.has_value()),
              "w4_gemv: the rotary epilogue needs positions and cos_sin");
  // The epilogues store without column checks: their geometry must be exact (w4_gemv_cuda's
  // supports_* check it first; this keeps a direct call from writing past `out`).
  const int64_t n_w = epilogue == w4::kEpiSiluMul ? 2 * out.size(1) : out.size(1);
  TORCH_CHECK(epilogue != w4::kEpiSiluMul || (n_w % 32 == 0 && period == n_w / 32),
              "w4_gemv: the SiLU epilogue needs N a multiple of 32 and period N / 32");
  TORCH_CHECK(epilogue != w4::kEpiRope ||
                  (half % 16 == 0 && period == half / 16 && n_w % (2 * half) == 0 &&
                   rot_cols % (2 * half) == 0 && rot_cols <= n_w &&
                   cos_sin->size(1) >= 2 * half && cos_sin->stride(1) == 1 &&
                   positions->numel() >= x.size(0) && positions->stride(0) == 1),
              "w4_gemv: the rotary epilogue needs half a multiple of 16, period half / 16, "
              "N and rot_cols multiples of 2 half, a [*, 2 half] table and one position per row");
  w4::Epilogue epi = {};
  epi.period = static_cast<int>(period);
  if (epilogue == w4::kEpiRope) {
    epi.positions = positions->data_ptr<int64_t>();
    epi.cos_sin = cos_sin->data_ptr<float>();
    epi.cos_sin_stride = cos_sin->stride(0);
    epi.rot_cols = static_cast<int>(rot_cols);
    epi.half = static_cast<int>(half);
  }
  return x.scalar_type() == at::kHalf
             ? dispatch<__half>(x, qweight, scales, zeros, bias, out, group_size, zero_value,
                                num_warps, unroll, nt, pdl, static_cast<int>(epilogue), epi)
             : dispatch<__nv_bfloat16>(x, qweight, scales, zeros, bias, out, group_size,
                                       zero_value, num_warps, unroll, nt, pdl,
                                       static_cast<int>(epilogue), epi);
}
#endif  // W4_NO_TORCH
