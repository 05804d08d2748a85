// Fused elementwise kernels of the decode step (everything around the GEMMs that is not the
// time-mix core of wkv7_tmix.cu). Pure-torch twins: server.model.ops.{add_ln_mix, relu_square,
// lora_act}. Each mimics the fp16/bf16 roundings of the torch sequence it replaces (every
// intermediate torch would store is rounded to F here too), so results match to ~1 ulp.
//
// add_ln_mix: one block per row b (B rows of C), up to VPT groups of 4 columns per thread:
//     x'   = dx ? round(x + dx) : x            (residual add; x' written to x_out when dx)
//     xn   = round(layer_norm(x') * w + b)     (eps, biased variance, as F.layer_norm)
//     prev = shift; shift = xn                 (when shift: the token-shift state, in place)
//     K == 0: out = xn                         K > 0: d = round(prev - xn),
//                                                     out[k] = round(xn + d * mix[k])  (k < K)
// relu_square: h = round(max(h, 0)^2) in place.
// lora_act: a = tanh(a), g = sigmoid(g) in place (two buffers, one launch).
#include "wkv7_common.cuh"

namespace wkv7 {

constexpr int LN_VPT = 4;  // groups of 4 columns per thread (C <= 16 * 1024)

struct LnArgs {
    const void *x, *dx, *ln_w, *ln_b, *mix;
    void *shift, *x_out, *out;
    long long x_bs, dx_bs, shift_bs, xo_bs, out_bs, out_plane;
    int C, K;
    float eps;
};

template <typename F>
__device__ __forceinline__ float rnd(float x) { return to_f(from_f<F>(x)); }

template <typename F>
__device__ __forceinline__ void store4(F *p, const float *v) {
    if constexpr (sizeof(F) == 4) {
        *reinterpret_cast<float4 *>(p) = make_float4(v[0], v[1], v[2], v[3]);
    } else {
        F q[4] = {from_f<F>(v[0]), from_f<F>(v[1]), from_f<F>(v[2]), from_f<F>(v[3])};
        *reinterpret_cast<uint2 *>(p) = *reinterpret_cast<uint2 *>(q);
    }
}

// Sum over the block (blockDim.x a multiple of 32, <= 1024); red: 32 floats of shared memory.
__device__ __forceinline__ float block_sum(float v, float *red) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    if ((threadIdx.x & 31) == 0) red[w] = v;
    __syncthreads();
    float s = 0.f;
    for (int i = 0; i < nw; i++) s += red[i];
    __syncthreads();  // red is reused by the next call
    return s;
}

template <typename F>
__global__ void __launch_bounds__(1024) add_ln_mix_kernel(LnArgs p) {
    __shared__ float red[32];
    const int b = blockIdx.x, tid = threadIdx.x, T = blockDim.x, nv = p.C >> 2;
    const F *x = (const F *)p.x + b * p.x_bs;
    const F *dx = p.dx ? (const F *)p.dx + b * p.dx_bs : nullptr;
    float v[4 * LN_VPT];
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < LN_VPT; j++) {
        const int c = 4 * (tid + j * T);
        if (c < p.C) {
            load4<F>(x + c, v + 4 * j);
            if (dx) {
                float d[4];
                load4<F>(dx + c, d);
#pragma unroll
                for (int e = 0; e < 4; e++) v[4 * j + e] = rnd<F>(v[4 * j + e] + d[e]);
                store4<F>((F *)p.x_out + b * p.xo_bs + c, v + 4 * j);
            }
#pragma unroll
            for (int e = 0; e < 4; e++) sum += v[4 * j + e];
        }
    }
    const float mean = block_sum(sum, red) / p.C;
    float sq = 0.f;
#pragma unroll
    for (int j = 0; j < LN_VPT; j++) {
        if (4 * (tid + j * T) < p.C) {
#pragma unroll
            for (int e = 0; e < 4; e++) sq += (v[4 * j + e] - mean) * (v[4 * j + e] - mean);
        }
    }
    const float rstd = rsqrtf(block_sum(sq, red) / p.C + p.eps);
    (void)nv;
#pragma unroll
    for (int j = 0; j < LN_VPT; j++) {
        const int c = 4 * (tid + j * T);
        if (c >= p.C) continue;
        float w[4], bb[4], xn[4];
        load4<F>((const F *)p.ln_w + c, w);
        load4<F>((const F *)p.ln_b + c, bb);
#pragma unroll
        for (int e = 0; e < 4; e++) xn[e] = rnd<F>((v[4 * j + e] - mean) * rstd * w[e] + bb[e]);
        float d[4];
        if (p.shift) {
            F *sh = (F *)p.shift + b * p.shift_bs + c;
            float prev[4];
            load4<F>(sh, prev);
            store4<F>(sh, xn);
#pragma unroll
            for (int e = 0; e < 4; e++) d[e] = rnd<F>(prev[e] - xn[e]);
        }
        F *out = (F *)p.out + b * p.out_bs + c;
        if (p.K == 0) {
            store4<F>(out, xn);
        } else {
            for (int k = 0; k < p.K; k++) {
                float m[4], o[4];
                load4<F>((const F *)p.mix + (long long)k * p.C + c, m);
#pragma unroll
                for (int e = 0; e < 4; e++) o[e] = xn[e] + d[e] * m[e];
                store4<F>(out + k * p.out_plane, o);
            }
        }
    }
}

template <typename F>
__global__ void relu_square_kernel(F *__restrict__ h, long long n) {
    const long long n4 = n >> 2;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n4; i += stride) {
        float v[4];
        load4<F>(h + 4 * i, v);
#pragma unroll
        for (int e = 0; e < 4; e++) v[e] = fmaxf(v[e], 0.f) * fmaxf(v[e], 0.f);
        store4<F>(h + 4 * i, v);
    }
    for (long long i = 4 * n4 + (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const float x = fmaxf(to_f(h[i]), 0.f);
        h[i] = from_f<F>(x * x);
    }
}

template <typename F>
__global__ void lora_act_kernel(F *__restrict__ a, long long na, F *__restrict__ g, long long ng) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < na + ng; i += stride) {
        if (i < na) {
            a[i] = from_f<F>(tanhf(to_f(a[i])));
        } else {
            const float x = to_f(g[i - na]);
            g[i - na] = from_f<F>(1.f / (1.f + expf(-x)));
        }
    }
}

}  // namespace wkv7

#define WKV7_FE_DISPATCH(f_dt, ...)                                             \
    [&]() -> int {                                                              \
        using namespace wkv7;                                                   \
        if (f_dt == DT_F16) { using F = __half; __VA_ARGS__ }                   \
        if (f_dt == DT_BF16) { using F = __nv_bfloat16; __VA_ARGS__ }           \
        if (f_dt == DT_F32) { using F = float; __VA_ARGS__ }                    \
        return -1;                                                              \
    }()

// All tensors in dtype f_dt; rows of C with the given strides (elements); C % 4 == 0; 16-byte
// (fp32) / 8-byte (16-bit) aligned rows. dx, shift may be null; K == 0: out is (B, C), else
// K planes of out_plane elements. Returns a cudaError_t value, or -1 (bad dtype / C too large).
extern "C" int fused_add_ln_mix(int f_dt, int B, int C, const void *x, long long x_bs, const void *dx,
                                long long dx_bs, const void *ln_w, const void *ln_b, float eps, void *shift,
                                long long shift_bs, const void *mix, int K, void *x_out, long long xo_bs,
                                void *out, long long out_bs, long long out_plane, void *stream) {
    if (B <= 0) return 0;
    const int nv = C / 4;
    if (C % 4 || nv > 1024 * wkv7::LN_VPT) return -1;
    int threads = ((nv + wkv7::LN_VPT - 1) / wkv7::LN_VPT + 31) / 32 * 32;
    threads = threads < 128 ? 128 : threads;
    wkv7::LnArgs p{x, dx, ln_w, ln_b, mix, shift, x_out, out, x_bs, dx_bs, shift_bs, xo_bs, out_bs, out_plane,
                   C, K, eps};
    return WKV7_FE_DISPATCH(f_dt, {
        add_ln_mix_kernel<F><<<B, threads, 0, (cudaStream_t)stream>>>(p);
        return (int)cudaGetLastError();
    });
}

// h: n contiguous elements (8-byte aligned for 16-bit, 16-byte for fp32), in place.
extern "C" int fused_relu_square(int f_dt, void *h, long long n, void *stream) {
    if (n <= 0) return 0;
    long long blocks = (n / 4 + 255) / 256;
    blocks = blocks < 1 ? 1 : (blocks > 8192 ? 8192 : blocks);
    return WKV7_FE_DISPATCH(f_dt, {
        relu_square_kernel<F><<<(int)blocks, 256, 0, (cudaStream_t)stream>>>((F *)h, n);
        return (int)cudaGetLastError();
    });
}

// a (na elements) <- tanh(a), g (ng elements) <- sigmoid(g), both contiguous, in place.
extern "C" int fused_lora_act(int f_dt, void *a, long long na, void *g, long long ng, void *stream) {
    if (na + ng <= 0) return 0;
    long long blocks = (na + ng + 255) / 256;
    blocks = blocks > 8192 ? 8192 : blocks;
    return WKV7_FE_DISPATCH(f_dt, {
        lora_act_kernel<F><<<(int)blocks, 256, 0, (cudaStream_t)stream>>>((F *)a, na, (F *)g, ng);
        return (int)cudaGetLastError();
    });
}
