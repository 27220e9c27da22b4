// W4A16 GEMV for decode (M = 1..8 rows of x) on tensor cores: y = x @ W^T (+ bias).
// Built by w4_gemv_cuda.py (torch.utils.cpp_extension.load_inline); the layout of the repacked
// weight and the numerics are described there.
//
// One block owns 16 output columns (one "tile") and its warps split the K range between them:
// warp w takes the 64-row chunks w, w + W, w + 2W, ... (W warps), so that the warps of a block
// stream adjacent 512-byte pieces of the tile. Per chunk each lane loads one uint4 of weights
// (its A fragments of four m16n8k16 MMAs) and two uint4 of x (its B fragments), dequantizes the
// words with lop3 into fp16x2 / bf16x2 values q - z (exact), and the tensor cores accumulate
// x * (q - z) in fp32. The group's scale multiplies the chunk's fp32 sum once. The warps' sums
// meet in shared memory at the end; no split-K across blocks, no second kernel, no atomics.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>

namespace w4 {

constexpr int kTileN = 16;    // output columns of a block (the MMA's M)
constexpr int kChunkK = 64;   // K rows of one lane's uint4 (two k32 steps)
constexpr int kMaxM = 8;      // the MMA's N: rows of x

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

// Lane layout (m16n8k16 fragments): g = lane / 4 picks the output columns g and g + 8 of the
// tile (A rows) and the row g of x (B column); t = lane % 4 picks the lane's 8 K rows in each
// k32 step: 8 t .. 8 t + 7. Its uint4 of a chunk: {step 0 col g, step 0 col g + 8, step 1 col g,
// step 1 col g + 8}.
//
// STEP_SCALE: groups of 32 rows (a scale per k32 step), else a scale per 64-row chunk
// (group_size a multiple of 64, or a single group).
template <typename T, bool HAS_ZEROS, bool STEP_SCALE, int UNROLL>
__global__ void __launch_bounds__(512) w4_gemv_kernel(
    const T* __restrict__ x,              // [M, K]
    const uint4* __restrict__ qweight,    // [N_pad / 16, K_pad / 64, 32] uint4 (repacked)
    const uint16_t* __restrict__ scales,  // [G, N] fp16 or bf16 (scales_bf16)
    const int16_t* __restrict__ zeros,    // [G, N] (HAS_ZEROS)
    const T* __restrict__ bias,           // [N] or nullptr
    T* __restrict__ out,                  // [M, N]
    int m, int n, int k, int num_groups, int group_size, int zero_value, bool scales_bf16) {
  extern __shared__ float partial[];  // [num_warps][kMaxM][kTileN]
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int num_warps = blockDim.x / 32;
  const int g = lane / 4;
  const int t = lane % 4;
  const int tile = blockIdx.x;
  const int num_chunks = (k + kChunkK - 1) / kChunkK;
  const int col0 = min(tile * kTileN + g, n - 1);      // clamped: padded columns read column n-1
  const int col1 = min(tile * kTileN + g + 8, n - 1);
  const uint4* wtile = qweight + static_cast<size_t>(tile) * num_chunks * 32 + lane;
  const T* xrow = x + static_cast<size_t>(g) * k + 8 * t;
  const bool has_row = g < m;

  float acc[4] = {0.f, 0.f, 0.f, 0.f};  // (col g, row 2t), (col g, 2t+1), (g+8, 2t), (g+8, 2t+1)
  constexpr int kSteps = STEP_SCALE ? 2 : 1;  // scale / zero rows per chunk
  for (int c_base = warp; c_base < num_chunks; c_base += num_warps * UNROLL) {
    uint4 wv[UNROLL];
    uint16_t sv[UNROLL][kSteps][2];  // raw scales of columns g, g + 8
    int16_t zv[UNROLL][kSteps][2];
    // The batch's weights, scales and zeros first, so that UNROLL x 16 bytes of weights per
    // lane are in flight and no HBM load waits behind an MMA.
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int c = c_base + u * num_warps;
      if (c < num_chunks) {
        wv[u] = load_stream(wtile + static_cast<size_t>(c) * 32);
#pragma unroll
        for (int s = 0; s < kSteps; ++s) {
          const int grp = min((c * kChunkK + s * 32) / group_size, num_groups - 1);
          const size_t base = static_cast<size_t>(grp) * n;
          sv[u][s][0] = __ldg(scales + base + col0);
          sv[u][s][1] = __ldg(scales + base + col1);
          if (HAS_ZEROS) {
            zv[u][s][0] = __ldg(zeros + base + col0);
            zv[u][s][1] = __ldg(zeros + base + col1);
          }
        }
      }
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int c = c_base + u * num_warps;
      if (c >= num_chunks) break;  // warp-uniform
      const uint32_t words[4] = {wv[u].x, wv[u].y, wv[u].z, wv[u].w};
      // x is small and read by every block: an L1 / L2 hit, loaded here rather than with the
      // weights to keep the registers of UNROLL chunks of x free.
      uint4 xv[2];
#pragma unroll
      for (int s = 0; s < 2; ++s) {
        const int k0 = c * kChunkK + s * 32 + 8 * t;
        const uint4* xp = reinterpret_cast<const uint4*>(xrow + c * kChunkK + s * 32);
        xv[s] = (has_row && k0 < k) ? __ldg(xp) : make_uint4(0, 0, 0, 0);
      }
      float part[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int s = 0; s < 2; ++s) {
        const int gs = STEP_SCALE ? s : 0;
        const int z0 = HAS_ZEROS ? zv[u][gs][0] : zero_value;
        const int z1 = HAS_ZEROS ? zv[u][gs][1] : zero_value;
        uint32_t a0[4], a1[4];  // columns g and g + 8: (k0,k1) (k2,k3) (k4,k5) (k6,k7)
        Dequant<T>::run(words[2 * s], z0, a0);
        Dequant<T>::run(words[2 * s + 1], z1, a1);
        const uint32_t frag_lo[4] = {a0[0], a1[0], a0[1], a1[1]};
        const uint32_t frag_hi[4] = {a0[2], a1[2], a0[3], a1[3]};
        mma_16816<T>(part, frag_lo, xv[s].x, xv[s].y);
        mma_16816<T>(part, frag_hi, xv[s].z, xv[s].w);
        if (STEP_SCALE || s == 1) {
          const float s0 = scale_to_float(sv[u][gs][0], scales_bf16);
          const float s1 = scale_to_float(sv[u][gs][1], scales_bf16);
          acc[0] = fmaf(part[0], s0, acc[0]);
          acc[1] = fmaf(part[1], s0, acc[1]);
          acc[2] = fmaf(part[2], s1, acc[2]);
          acc[3] = fmaf(part[3], s1, acc[3]);
          part[0] = part[1] = part[2] = part[3] = 0.f;
        }
      }
    }
  }

  // The warps' sums -> shared memory [warp][row of x][column], then one thread per output.
  float* mine = partial + warp * kMaxM * kTileN;
  mine[(2 * t) * kTileN + g] = acc[0];
  mine[(2 * t + 1) * kTileN + g] = acc[1];
  mine[(2 * t) * kTileN + g + 8] = acc[2];
  mine[(2 * t + 1) * kTileN + g + 8] = acc[3];
  __syncthreads();
  for (int i = threadIdx.x; i < kMaxM * kTileN; i += blockDim.x) {  // blocks of 1..4 warps too
    const int row = i / kTileN;
    const int col = tile * kTileN + i % kTileN;
    if (row < m && col < n) {
      float sum = 0.f;
      for (int w = 0; w < num_warps; ++w) sum += partial[w * kMaxM * kTileN + i];
      if (bias != nullptr) sum += to_float(bias[col]);
      out[static_cast<size_t>(row) * n + col] = from_float<T>(sum);
    }
  }
}

}  // namespace w4

#ifndef W4_NO_TORCH
#include <ATen/cuda/CUDAContext.h>
#include <torch/extension.h>

template <typename T, bool HAS_ZEROS, bool STEP_SCALE, int UNROLL>
static void launch(const torch::Tensor& x, const torch::Tensor& qweight,
                   const torch::Tensor& scales, const std::optional<torch::Tensor>& zeros,
                   const std::optional<torch::Tensor>& bias, torch::Tensor& out, int group_size,
                   int zero_value, int num_warps) {
  const int m = x.size(0), k = x.size(1), n = out.size(1);
  const int num_tiles = (n + w4::kTileN - 1) / w4::kTileN;
  const size_t smem = sizeof(float) * num_warps * w4::kMaxM * w4::kTileN;
  auto stream = at::cuda::getCurrentCUDAStream();
  w4::w4_gemv_kernel<T, HAS_ZEROS, STEP_SCALE, UNROLL><<<num_tiles, num_warps * 32, smem, stream>>>(
      reinterpret_cast<const T*>(x.data_ptr()),
      reinterpret_cast<const uint4*>(qweight.data_ptr()),
      reinterpret_cast<const uint16_t*>(scales.data_ptr()),
      HAS_ZEROS ? reinterpret_cast<const int16_t*>(zeros->data_ptr()) : nullptr,
      bias.has_value() ? reinterpret_cast<const T*>(bias->data_ptr()) : nullptr,
      reinterpret_cast<T*>(out.data_ptr()), m, n, k, scales.size(0), group_size, zero_value,
      scales.scalar_type() == at::kBFloat16);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T>
static void dispatch(const torch::Tensor& x, const torch::Tensor& qweight,
                     const torch::Tensor& scales, const std::optional<torch::Tensor>& zeros,
                     const std::optional<torch::Tensor>& bias, torch::Tensor& out, int group_size,
                     int zero_value, int num_warps, int unroll) {
  const bool step = group_size % 64 != 0 && scales.size(0) > 1;
  const bool z = zeros.has_value();
#define W4_CASE(Z, S, U)                                                                    \
  if (z == Z && step == S && unroll == U)                                                   \
    return launch<T, Z, S, U>(x, qweight, scales, zeros, bias, out, group_size, zero_value, \
                              num_warps);
  W4_CASE(false, false, 4) W4_CASE(false, true, 4) W4_CASE(true, false, 4) W4_CASE(true, true, 4)
  W4_CASE(false, false, 8) W4_CASE(false, true, 8) W4_CASE(true, false, 8) W4_CASE(true, true, 8)
  W4_CASE(false, false, 2) W4_CASE(false, true, 2) W4_CASE(true, false, 2) W4_CASE(true, true, 2)
#undef W4_CASE
  TORCH_CHECK(false, "w4_gemv: unroll must be 2, 4 or 8, got ", unroll);
}

// out [M, N] = x [M, K] @ W^T (+ bias); the caller checks shapes, dtypes and alignment.
void w4_gemv_out(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales,
                 std::optional<torch::Tensor> zeros, std::optional<torch::Tensor> bias,
                 torch::Tensor out, int64_t group_size, int64_t zero_value, int64_t num_warps,
                 int64_t unroll) {
  TORCH_CHECK(x.size(0) <= w4::kMaxM && num_warps >= 1 && num_warps <= 16, "w4_gemv: bad M/warps");
  if (x.scalar_type() == at::kHalf) {
    dispatch<__half>(x, qweight, scales, zeros, bias, out, group_size, zero_value, num_warps,
                     unroll);
  } else {
    dispatch<__nv_bfloat16>(x, qweight, scales, zeros, bias, out, group_size, zero_value,
                            num_warps, unroll);
  }
}
#endif  // W4_NO_TORCH
