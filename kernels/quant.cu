// Per-row (per-token) e4m3 quantization of activations, the fp8 GEMM path's input (torch._scaled_mm
// with per-row scales): for each row m of x (rows, K)
//     amax = max_k |a[m][k]|,  q[m][k] = sat_e4m3(a[m][k] * (448 / amax)) (round to nearest even),
//     scale[m] = amax / 448    (an all-zero row: multiplier 1, scale 1, codes 0)
// where a = x, or with act = 1 a = round(relu(x)^2) in x's dtype (the channel mix's activation, as
// ops.relu_square rounds it: ffn_value's input is quantized without a separate relu_square).
// Pure-torch twin: server.model.qlinear.quant_rows_native (bitwise the same codes and scales).
// One block per row: the row is read twice (absmax, then codes; the second read hits L1/L2).
// Requirements (else -2, nothing launched): K % 8 == 0, x and q 16-byte aligned, row strides
// multiples of 8 (x) and 16 (q) elements, f_dt fp16 or bf16.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

namespace quant_k {

constexpr int THREADS = 256;
constexpr float FP8_MAX = 448.f;

template <typename F>
__device__ __forceinline__ void load8(const F *p, float *v, bool relu2) {
    const uint4 u = *reinterpret_cast<const uint4 *>(p);
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        float2 f;
        if constexpr (std::is_same<F, __half>::value) f = __half22float2(*reinterpret_cast<const __half2 *>(&w[i]));
        else f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(&w[i]));
        if (relu2) {  // relu(x)^2 computed in fp32, rounded to F once (ops.relu_square's bits)
            f.x = fmaxf(f.x, 0.f), f.y = fmaxf(f.y, 0.f);
            if constexpr (std::is_same<F, __half>::value) f = __half22float2(__floats2half2_rn(f.x * f.x, f.y * f.y));
            else f = __bfloat1622float2(__floats2bfloat162_rn(f.x * f.x, f.y * f.y));
        }
        v[2 * i] = f.x, v[2 * i + 1] = f.y;
    }
}

template <typename F>
__global__ void __launch_bounds__(THREADS) quant_rows_kernel(const F *x, long long x_s, int K, int relu2,
                                                              uint8_t *q, long long q_s, float *scale) {
    __shared__ float red[THREADS / 32];
    const int row = blockIdx.x;
    const F *xr = x + row * x_s;
    float amax = 0.f, v[8];
    for (int k = threadIdx.x * 8; k < K; k += THREADS * 8) {
        load8(xr + k, v, relu2);
#pragma unroll
        for (int i = 0; i < 8; i++) amax = fmaxf(amax, fabsf(v[i]));
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = amax;
    __syncthreads();
    amax = red[0];
#pragma unroll
    for (int i = 1; i < THREADS / 32; i++) amax = fmaxf(amax, red[i]);
    const float inv = amax > 0.f ? FP8_MAX / amax : 1.f;
    if (threadIdx.x == 0) scale[row] = amax > 0.f ? amax / FP8_MAX : 1.f;
    uint8_t *qr = q + row * q_s;
    for (int k = threadIdx.x * 8; k < K; k += THREADS * 8) {
        load8(xr + k, v, relu2);
        uint16_t c[4];
#pragma unroll
        for (int i = 0; i < 4; i++)
            c[i] = __nv_cvt_float2_to_fp8x2(make_float2(v[2 * i] * inv, v[2 * i + 1] * inv), __NV_SATFINITE, __NV_E4M3);
        *reinterpret_cast<uint2 *>(qr + k) = make_uint2(c[0] | (uint32_t)c[1] << 16, c[2] | (uint32_t)c[3] << 16);
    }
}

}  // namespace quant_k

// f_dt: 1 fp16, 2 bf16. x (rows, K) row stride x_s; q (rows, K) e4m3 bytes, row stride q_s; scale
// (rows,) fp32. act: 0 x as is, 1 round(relu(x)^2). Returns 0, -2 (not covered) or a CUDA error.
extern "C" int quant_rows_fp8(int f_dt, int rows, int K, const void *x, long long x_s, int act, void *q,
                              long long q_s, void *scale, void *stream) {
    using namespace quant_k;
    if (rows == 0) return 0;
    if (rows < 0 || K <= 0 || K % 8 || x_s % 8 || q_s % 16 || act < 0 || act > 1) return -2;
    if (((uintptr_t)x & 15) || ((uintptr_t)q & 15)) return -2;
    cudaStream_t s = (cudaStream_t)stream;
    auto *qq = static_cast<uint8_t *>(q);
    auto *sc = static_cast<float *>(scale);
    if (f_dt == 1)
        quant_rows_kernel<__half><<<rows, THREADS, 0, s>>>(static_cast<const __half *>(x), x_s, K, act, qq, q_s, sc);
    else if (f_dt == 2)
        quant_rows_kernel<__nv_bfloat16>
            <<<rows, THREADS, 0, s>>>(static_cast<const __nv_bfloat16 *>(x), x_s, K, act, qq, q_s, sc);
    else
        return -2;
    return (int)cudaGetLastError();
}
