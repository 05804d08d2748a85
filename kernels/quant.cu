// Per-row (per-token) e4m3 quantization of activations, the fp8 GEMM path's input (torch._scaled_mm
// with per-row scales): for each row m of x (rows, K)
//     amax = max_k |a[m][k]|,  q[m][k] = sat_e4m3(a[m][k] * (448 / amax)) (round to nearest even),
//     scale[m] = amax / 448    (an all-zero row: multiplier 1, scale 1, codes 0)
// where a = x, or with act = 1 a = round(relu(x)^2) in x's dtype (the channel mix's activation, as
// ops.relu_square rounds it: ffn_value's input is quantized without a separate relu_square).
// Scaled input (xrow, xcol given: x holds a qlinear.ScaledProduct's raw sums): x[m][k] is first
// replaced by round((x[m][k] * (xrow[m] * 2^20)) * xcol[k]) in x's dtype, the product's value as
// ScaledProduct.value() computes it, rounded as the per-row GEMM rounds its output.
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

constexpr float RAW_INV = 1048576.f;  // 1 / qlinear.RAW_UNIT

template <typename F>
__device__ __forceinline__ float2 round2(float a, float b) {  // both values rounded to F
    if constexpr (std::is_same<F, __half>::value) return __half22float2(__floats2half2_rn(a, b));
    else return __bfloat1622float2(__floats2bfloat162_rn(a, b));
}

// 8 values of a row from k on (p = the row + k); SCALED: raw sums times rm = xrow[m] * 2^20 and
// col = xcol + k, rounded to F
template <typename F, bool SCALED>
__device__ __forceinline__ void load8(const F *p, float *v, bool relu2, float rm, const float *col) {
    const uint4 u = *reinterpret_cast<const uint4 *>(p);
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
    float c[8];
    if constexpr (SCALED) {
        const float4 c0 = reinterpret_cast<const float4 *>(col)[0], c1 = reinterpret_cast<const float4 *>(col)[1];
        c[0] = c0.x, c[1] = c0.y, c[2] = c0.z, c[3] = c0.w, c[4] = c1.x, c[5] = c1.y, c[6] = c1.z, c[7] = c1.w;
    }
#pragma unroll
    for (int i = 0; i < 4; i++) {
        float2 f;
        if constexpr (std::is_same<F, __half>::value) f = __half22float2(*reinterpret_cast<const __half2 *>(&w[i]));
        else f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(&w[i]));
        if constexpr (SCALED) f = round2<F>((f.x * rm) * c[2 * i], (f.y * rm) * c[2 * i + 1]);
        if (relu2) {  // relu(x)^2 computed in fp32, rounded to F once (ops.relu_square's bits)
            f.x = fmaxf(f.x, 0.f), f.y = fmaxf(f.y, 0.f);
            f = round2<F>(f.x * f.x, f.y * f.y);
        }
        v[2 * i] = f.x, v[2 * i + 1] = f.y;
    }
}

template <typename F, bool SCALED>
__global__ void __launch_bounds__(THREADS) quant_rows_kernel(const F *x, long long x_s, int K, int relu2,
                                                              uint8_t *q, long long q_s, float *scale,
                                                              const float *xrow, const float *xcol) {
    __shared__ float red[THREADS / 32];
    const int row = blockIdx.x;
    const F *xr = x + row * x_s;
    const float rm = SCALED ? xrow[row] * RAW_INV : 1.f;
    float amax = 0.f, v[8];
    for (int k = threadIdx.x * 8; k < K; k += THREADS * 8) {
        load8<F, SCALED>(xr + k, v, relu2, rm, xcol + k);
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
        load8<F, SCALED>(xr + k, v, relu2, rm, xcol + k);
        uint16_t c[4];
#pragma unroll
        for (int i = 0; i < 4; i++)
            c[i] = __nv_cvt_float2_to_fp8x2(make_float2(v[2 * i] * inv, v[2 * i + 1] * inv), __NV_SATFINITE, __NV_E4M3);
        *reinterpret_cast<uint2 *>(qr + k) = make_uint2(c[0] | (uint32_t)c[1] << 16, c[2] | (uint32_t)c[3] << 16);
    }
}

template <typename F>
int launch(int rows, int K, const void *x, long long x_s, int act, uint8_t *q, long long q_s, float *sc,
           const float *xrow, const float *xcol, cudaStream_t s) {
    const F *xf = static_cast<const F *>(x);
    if (xrow)
        quant_rows_kernel<F, true><<<rows, THREADS, 0, s>>>(xf, x_s, K, act, q, q_s, sc, xrow, xcol);
    else
        quant_rows_kernel<F, false><<<rows, THREADS, 0, s>>>(xf, x_s, K, act, q, q_s, sc, nullptr, nullptr);
    return (int)cudaGetLastError();
}

}  // namespace quant_k

// f_dt: 1 fp16, 2 bf16. x (rows, K) row stride x_s; q (rows, K) e4m3 bytes, row stride q_s; scale
// (rows,) fp32. act: 0 x as is, 1 round(relu(x)^2). xrow (rows,) and xcol (K,) fp32: both null,
// or x is a ScaledProduct's raw sums with these scales (16-byte aligned xcol). Returns 0, -2 (not
// covered) or a CUDA error.
extern "C" int quant_rows_fp8(int f_dt, int rows, int K, const void *x, long long x_s, int act, void *q,
                              long long q_s, void *scale, const void *xrow, const void *xcol, void *stream) {
    using namespace quant_k;
    if (rows == 0) return 0;
    if (rows < 0 || K <= 0 || K % 8 || x_s % 8 || q_s % 16 || act < 0 || act > 1) return -2;
    if (((uintptr_t)x & 15) || ((uintptr_t)q & 15) || (!xrow != !xcol) || ((uintptr_t)xcol & 15)) return -2;
    cudaStream_t s = (cudaStream_t)stream;
    auto *qq = static_cast<uint8_t *>(q);
    auto *sc = static_cast<float *>(scale);
    auto *xr = static_cast<const float *>(xrow), *xc = static_cast<const float *>(xcol);
    if (f_dt == 1) return launch<__half>(rows, K, x, x_s, act, qq, q_s, sc, xr, xc, s);
    if (f_dt == 2) return launch<__nv_bfloat16>(rows, K, x, x_s, act, qq, q_s, sc, xr, xc, s);
    return -2;
}
