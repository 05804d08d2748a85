// Fused elementwise kernels of the decode step (everything around the GEMMs that is not the
// time-mix core of wkv7_tmix_fused.cu). Pure-torch twins: server.model.ops.{add_ln_mix, relu_square,
// lora_act}. Each mimics the fp16/bf16 roundings of the torch sequence it replaces (every
// intermediate torch would store is rounded to F here too), so results match to ~1 ulp.
//
// add_ln_mix: one block per row b (B rows of C). Fast path (add_ln_mix_v2_kernel): one group of
// LN_VW = 8 contiguous columns per thread for the whole row (C / 8 threads, 16-byte accesses;
// C % 8 == 0, C <= 4096, 16-byte aligned rows, K <= 6); every load (x, dx, shift, LN weights, the
// K mixes) is issued before any store, and mean/variance come from one block reduction of
// per-thread (count, mean, M2) triples (Chan's combine). Otherwise the general kernel below:
// up to VPT groups of 4 columns per thread. Both compute:
//     x'   = dx ? round(x + dx) : x            (residual add; x' written to x_out when dx)
//     xn   = round(layer_norm(x') * w + b)     (eps, biased variance, as F.layer_norm)
//     prev = shift; shift = xn                 (when shift: the token-shift state, in place)
//     K == 0: out = xn                         K > 0: d = round(prev - xn),
//                                                     out[k] = round(xn + d * mix[k])  (k < K)
// fused_add_ln_mix_fp8 (fast path, 16-bit F only): planes k < keep go to out as above, planes
// q0 <= k < K (they may overlap) as per-row e4m3 codes of out[k] with fp32 scales, the bits
// quant.cu's quant_rows_fp8 makes of the stored 16-bit plane: the fp8 GEMM's input without
// writing the plane in 16 bits and reading it back.
// relu_square: h = round(max(h, 0)^2) in place.
// lora_act: a = tanh(a), g = sigmoid(g) in place (two buffers, one launch).
#include <cuda_fp8.h>
#include <cuda_pipeline.h>

#include "pdl.cuh"
#include "wkv7_common.cuh"

namespace wkv7 {

constexpr int LN_VPT = 4;  // groups of 4 columns per thread (C <= 16 * 1024)

struct LnArgs {
    const void *x, *dx, *ln_w, *ln_b, *mix;
    void *shift, *x_out, *out;
    long long x_bs, dx_bs, shift_bs, xo_bs, out_bs, out_plane;
    int C, K;
    float eps;
    // e4m3 planes (fast path only; q == nullptr: none): codes of plane k at q + (k - q0) * q_plane
    // + b * q_bs, its scale at qs[(k - q0) * qs_plane + b]; 16-bit planes only for k < keep
    uint8_t *q;
    float *qs;
    long long q_bs, q_plane, qs_plane;
    int keep, q0;
};

constexpr float FP8_MAX = 448.f;
constexpr int LN_STAGES = 2;  // the fast path's rows in flight per block when it loops over rows

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
    rwkv_pdl::pdl_wait();
    rwkv_pdl::pdl_trigger();
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

constexpr int LN_VW = 8;     // fast path: columns per thread (16 bytes of 16-bit, 32 of fp32)
constexpr int LN_KMAX = 6;   // fast path: most mixes
constexpr int LN_V2_THREADS = 512;  // fast path: C <= 4096

// 8 consecutive values (16-byte aligned) <-> fp32.
template <typename F>
__device__ __forceinline__ void load8(const F *p, float *o) {
    if constexpr (sizeof(F) == 4) {
        cvt4(*reinterpret_cast<const float4 *>(p), o);
        cvt4(*reinterpret_cast<const float4 *>(p + 4), o + 4);
    } else {
        const uint4 x = *reinterpret_cast<const uint4 *>(p);
        cvt4(make_uint2(x.x, x.y), (const F *)nullptr, o);
        cvt4(make_uint2(x.z, x.w), (const F *)nullptr, o + 4);
    }
}

template <typename F>
__device__ __forceinline__ void store8(F *p, const float *v) {
    if constexpr (sizeof(F) == 4) {
        st_global_v4(p, make_uint4(__float_as_uint(v[0]), __float_as_uint(v[1]), __float_as_uint(v[2]),
                                   __float_as_uint(v[3])));
        st_global_v4(p + 4, make_uint4(__float_as_uint(v[4]), __float_as_uint(v[5]), __float_as_uint(v[6]),
                                       __float_as_uint(v[7])));
    } else {
        st_global_v4(p, make_uint4(pack2<F>(v[0], v[1]), pack2<F>(v[2], v[3]), pack2<F>(v[4], v[5]),
                                   pack2<F>(v[6], v[7])));
    }
}

// Chan's parallel combine of (count, mean, M2) into (n, mean, m2).
__device__ __forceinline__ void chan_combine(float &n, float &mean, float &m2, float nb, float meanb, float m2b) {
    const float nn = n + nb;
    if (nn > 0.f) {
        const float d = meanb - mean, f = nb / nn;
        mean = fmaf(d, f, mean);
        m2 = m2 + m2b + d * d * n * f;
        n = nn;
    }
}

// Launch bound of 1 block per SM: ptxas uses 76-80 registers (no spills), and 2 blocks of 320
// threads (C = 2560) still fit per SM. A bound of 2 would cap it at 64 registers with spills (a
// slower decode step: docs/performance.md).
// PIPE (16-bit F, more rows than resident blocks): each block loops over rows blockIdx.x +
// i * gridDim.x with the next row's x / dx / shift already on their way into shared memory
// (cp.async, LN_STAGES rows in flight per block): a row's reductions and stores overlap the next
// row's loads, and the weights are read once per block. Dynamic shared memory: LN_STAGES * 3 *
// blockDim.x * LN_VW elements of F.
template <typename F, bool Q8, bool PIPE>
__device__ __forceinline__ void ln_v2_body(const LnArgs &p, int B) {
    extern __shared__ __align__(16) unsigned char ln_stage[];
    __shared__ float red[2][3][32];           // by row parity: a row's writes never meet the last row's reads
    __shared__ float qred[2][LN_KMAX][32];    // Q8: the planes' absmax per warp, likewise
    const int tid = threadIdx.x;
    const int c = LN_VW * tid;
    const bool act = c < p.C;
    const bool has_dx = p.dx != nullptr, has_shift = p.shift != nullptr;
    const int wid = tid >> 5, nw = blockDim.x >> 5;
    float v[LN_VW], d[LN_VW], prev[LN_VW];
    // every load first (no store can alias them: each thread writes only its own columns). The
    // mix rows stay packed (16-bit: 4 registers per row; fp32 compute reads them after the
    // reduction): 76 registers, 2 blocks of 320 threads per SM (at 107 registers, with the mixes
    // unpacked to fp32, only one fit). The weights (LN w / b, mix rows) go out before the wait
    // for the predecessor (pdl.cuh); x, dx and the shift state after it.
    constexpr bool EARLY = sizeof(F) == 2;
    uint4 mraw[LN_KMAX], wraw[sizeof(F) / 2], braw[sizeof(F) / 2];  // LN w / b: 16 (fp32: 32) bytes
    if (act) {
#pragma unroll
        for (int i = 0; i < (int)sizeof(F) / 2; i++) {
            wraw[i] = reinterpret_cast<const uint4 *>((const F *)p.ln_w + c)[i];
            braw[i] = reinterpret_cast<const uint4 *>((const F *)p.ln_b + c)[i];
        }
        if constexpr (EARLY) {
#pragma unroll
            for (int k = 0; k < LN_KMAX; k++)
                if (k < p.K) mraw[k] = *reinterpret_cast<const uint4 *>((const F *)p.mix + (long long)k * p.C + c);
        }
    }
    rwkv_pdl::pdl_wait();
    rwkv_pdl::pdl_trigger();

    // row b from v / d / prev (loaded): residual add, LayerNorm, shift, mixes[, e4m3 planes]
    auto row = [&](const int b, const int par) {
        float n = 0.f, mean = 0.f, m2 = 0.f;  // this thread's (count, mean, M2)
        if (act) {
            if (has_dx) {
#pragma unroll
                for (int e = 0; e < LN_VW; e++) v[e] = rnd<F>(v[e] + d[e]);
            }
            float s = 0.f;
#pragma unroll
            for (int e = 0; e < LN_VW; e++) s += v[e];
            mean = s * (1.f / LN_VW);
#pragma unroll
            for (int e = 0; e < LN_VW; e++) m2 += (v[e] - mean) * (v[e] - mean);
            n = (float)LN_VW;
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float nb = __shfl_xor_sync(0xffffffffu, n, o), mb = __shfl_xor_sync(0xffffffffu, mean, o),
                        qb = __shfl_xor_sync(0xffffffffu, m2, o);
            chan_combine(n, mean, m2, nb, mb, qb);
        }
        if ((tid & 31) == 0) red[par][0][wid] = n, red[par][1][wid] = mean, red[par][2][wid] = m2;
        __syncthreads();
        n = red[par][0][0], mean = red[par][1][0], m2 = red[par][2][0];
        for (int i = 1; i < nw; i++) chan_combine(n, mean, m2, red[par][0][i], red[par][1][i], red[par][2][i]);
        if (!act && !Q8) return;  // with Q8 every thread meets the barrier below
        const float rstd = rsqrtf(m2 / p.C + p.eps);

        float xn[LN_VW];
        // plane k's mixed row before rounding: xn + d * mix[k]
        auto mixed = [&](int k, float *o) {
            if constexpr (EARLY) {
                cvt4(make_uint2(mraw[k].x, mraw[k].y), (const F *)nullptr, o);
                cvt4(make_uint2(mraw[k].z, mraw[k].w), (const F *)nullptr, o + 4);
            } else {
                load8<F>((const F *)p.mix + (long long)k * p.C + c, o);
            }
#pragma unroll
            for (int e = 0; e < LN_VW; e++) o[e] = xn[e] + d[e] * o[e];
        };
        if (act) {
            if (has_dx) store8<F>((F *)p.x_out + b * p.xo_bs + c, v);
            {
                float w[LN_VW], bb[LN_VW];
                load8<F>(reinterpret_cast<const F *>(wraw), w);
                load8<F>(reinterpret_cast<const F *>(braw), bb);
#pragma unroll
                for (int e = 0; e < LN_VW; e++) xn[e] = rnd<F>((v[e] - mean) * rstd * w[e] + bb[e]);
            }
            if (has_shift) {
                store8<F>((F *)p.shift + b * p.shift_bs + c, xn);
#pragma unroll
                for (int e = 0; e < LN_VW; e++) d[e] = rnd<F>(prev[e] - xn[e]);
            } else {
#pragma unroll
                for (int e = 0; e < LN_VW; e++) d[e] = 0.f;
            }
            F *out = (F *)p.out + b * p.out_bs + c;
            const int keep = Q8 ? p.keep : p.K;
            if (p.K == 0) {
                store8<F>(out, xn);
            } else {
#pragma unroll
                for (int k = 0; k < LN_KMAX; k++) {
                    if (k < keep) {
                        float o[LN_VW];
                        mixed(k, o);
                        store8<F>(out + k * p.out_plane, o);
                    }
                }
            }
        }
        if constexpr (Q8) {  // the e4m3 planes: each row's absmax over its rounded values, then codes
            float amax[LN_KMAX];
#pragma unroll
            for (int k = 0; k < LN_KMAX; k++) {
                if (k < p.q0 || k >= p.K) continue;
                amax[k] = 0.f;
                if (act) {
                    float o[LN_VW];
                    mixed(k, o);
#pragma unroll
                    for (int e = 0; e < LN_VW; e++) amax[k] = fmaxf(amax[k], fabsf(rnd<F>(o[e])));
                }
#pragma unroll
                for (int s = 16; s > 0; s >>= 1) amax[k] = fmaxf(amax[k], __shfl_xor_sync(0xffffffffu, amax[k], s));
                if ((tid & 31) == 0) qred[par][k][wid] = amax[k];
            }
            __syncthreads();
            if (!act) return;
#pragma unroll
            for (int k = 0; k < LN_KMAX; k++) {
                if (k < p.q0 || k >= p.K) continue;
                float a = qred[par][k][0];
                for (int i = 1; i < nw; i++) a = fmaxf(a, qred[par][k][i]);
                const float inv = a > 0.f ? FP8_MAX / a : 1.f;
                if (tid == 0) p.qs[(k - p.q0) * p.qs_plane + b] = a > 0.f ? a / FP8_MAX : 1.f;
                float o[LN_VW];
                mixed(k, o);
                uint16_t cd[LN_VW / 2];
#pragma unroll
                for (int i = 0; i < LN_VW / 2; i++)
                    cd[i] = __nv_cvt_float2_to_fp8x2(make_float2(rnd<F>(o[2 * i]) * inv, rnd<F>(o[2 * i + 1]) * inv),
                                                     __NV_SATFINITE, __NV_E4M3);
                *reinterpret_cast<uint2 *>(p.q + (k - p.q0) * p.q_plane + b * p.q_bs + c) =
                    make_uint2(cd[0] | (uint32_t)cd[1] << 16, cd[2] | (uint32_t)cd[3] << 16);
            }
        }
    };

    if constexpr (!PIPE) {
        const int b = blockIdx.x;
        if (act) {
            load8<F>((const F *)p.x + b * p.x_bs + c, v);
            if (has_dx) load8<F>((const F *)p.dx + b * p.dx_bs + c, d);
            if (has_shift) load8<F>((const F *)p.shift + b * p.shift_bs + c, prev);
        }
        row(b, 0);
    } else {
        static_assert(sizeof(F) * LN_VW == 16, "the staged path copies 16 bytes per tensor and thread");
        F *stage = reinterpret_cast<F *>(ln_stage);
        auto slot = [&](int s, int t) { return stage + ((s * 3 + t) * blockDim.x + tid) * LN_VW; };
        auto issue = [&](int rb, int s) {  // row rb's x / dx / shift for this thread into slot s
            if (act && rb < B) {
                __pipeline_memcpy_async(slot(s, 0), (const F *)p.x + rb * p.x_bs + c, 16);
                if (has_dx) __pipeline_memcpy_async(slot(s, 1), (const F *)p.dx + rb * p.dx_bs + c, 16);
                if (has_shift) __pipeline_memcpy_async(slot(s, 2), (const F *)p.shift + rb * p.shift_bs + c, 16);
            }
            __pipeline_commit();  // every thread, every row: the same group count everywhere
        };
        const int G = gridDim.x;
        for (int s = 0; s < LN_STAGES - 1; s++) issue(blockIdx.x + s * G, s);
        int it = 0;
        for (int b = blockIdx.x; b < B; b += G, it++) {
            issue(b + (LN_STAGES - 1) * G, (it + LN_STAGES - 1) % LN_STAGES);
            __pipeline_wait_prior(LN_STAGES - 1);  // this thread's copies of row b have landed
            const int s = it % LN_STAGES;
            if (act) {
                load8<F>(slot(s, 0), v);
                if (has_dx) load8<F>(slot(s, 1), d);
                if (has_shift) load8<F>(slot(s, 2), prev);
            }
            row(b, it & 1);
        }
    }
}

template <typename F, bool Q8>
__global__ void __launch_bounds__(LN_V2_THREADS, 1) add_ln_mix_v2_kernel(LnArgs p, int B) {
    ln_v2_body<F, Q8, false>(p, B);
}

// The staged body, two blocks per SM: up to LN_PIPE_THREADS threads (C <= 8 * that).
constexpr int LN_PIPE_THREADS = 320;
template <typename F, bool Q8>
__global__ void __launch_bounds__(LN_PIPE_THREADS, 2) add_ln_mix_pipe_kernel(LnArgs p, int B) {
    ln_v2_body<F, Q8, true>(p, B);
}

template <typename F>
__global__ void relu_square_kernel(F *__restrict__ h, long long n) {
    rwkv_pdl::pdl_wait();
    rwkv_pdl::pdl_trigger();
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
    rwkv_pdl::pdl_wait();
    rwkv_pdl::pdl_trigger();
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

namespace wkv7 {
// Whether p takes the fast path (16-byte aligned rows of whole 8-column groups, one per thread).
inline bool ln_fast(const LnArgs &p, int B) {
    auto al16 = [](const void *q) { return ((uintptr_t)q & 15) == 0; };
    bool fast = p.C % LN_VW == 0 && p.C / LN_VW <= LN_V2_THREADS && p.K <= LN_KMAX;
    fast = fast && al16(p.x) && al16(p.dx) && al16(p.ln_w) && al16(p.ln_b) && al16(p.mix) && al16(p.shift) &&
           al16(p.x_out) && al16(p.out);
    fast = fast && (B == 1 || (p.x_bs % LN_VW == 0 && p.dx_bs % LN_VW == 0 && p.shift_bs % LN_VW == 0 &&
                               p.xo_bs % LN_VW == 0 && p.out_bs % LN_VW == 0));
    return fast && (p.K <= 1 || p.out_plane % LN_VW == 0);
}

// Resident blocks of kern at this block size and dynamic shared memory, times the SMs: the
// staged kernel's grid (0 when the query fails). Cached per kernel and block size.
template <typename K>
inline int ln_slots(K kern, int threads, size_t smem) {
    static int cache[LN_V2_THREADS / 32 + 1] = {};
    int &slot = cache[threads / 32];
    if (slot == 0) {
        int dev = 0, sms = 0, per = 0;
        if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess)
            return 0;
        if (smem > 48 * 1024) cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per, kern, threads, smem) != cudaSuccess) return 0;
        slot = per * sms;
    }
    return slot;
}

template <typename F, bool Q8>
inline int launch_fast(const LnArgs &p, int B, cudaStream_t st) {
    const int threads = ((p.C / LN_VW) + 31) / 32 * 32;
    if constexpr (sizeof(F) == 2) {
        const size_t smem = (size_t)LN_STAGES * 3 * threads * LN_VW * sizeof(F);
        const int slots = threads <= LN_PIPE_THREADS ? ln_slots(add_ln_mix_pipe_kernel<F, Q8>, threads, smem) : 0;
        if (slots > 0 && B > slots)
            return (int)rwkv_pdl::launch_pdl(add_ln_mix_pipe_kernel<F, Q8>, dim3(slots), dim3(threads), smem, st, p, B);
    }
    return (int)rwkv_pdl::launch_pdl(add_ln_mix_v2_kernel<F, Q8>, dim3(B), dim3(threads), 0, st, p, B);
}

inline int launch_ln(const LnArgs &p, int f_dt, int B, bool fast, void *stream) {
    const auto st = (cudaStream_t)stream;
    if (fast && p.q) return WKV7_F_DISPATCH(f_dt, { return launch_fast<F, true>(p, B, st); });
    if (fast) return WKV7_F_DISPATCH(f_dt, { return launch_fast<F, false>(p, B, st); });
    int threads = ((p.C / 4 + LN_VPT - 1) / LN_VPT + 31) / 32 * 32;
    threads = threads < 128 ? 128 : threads;
    return WKV7_F_DISPATCH(f_dt, { return (int)rwkv_pdl::launch_pdl(add_ln_mix_kernel<F>, dim3(B), dim3(threads), 0, st, p); });
}
}  // namespace wkv7

// All tensors in dtype f_dt; rows of C with the given strides (elements); C % 4 == 0; 16-byte
// (fp32) / 8-byte (16-bit) aligned rows. dx, shift may be null; K == 0: out is (B, C), else
// K planes of out_plane elements. Returns a cudaError_t value, or -1 (bad dtype / C too large).
extern "C" int fused_add_ln_mix(int f_dt, int B, int C, const void *x, long long x_bs, const void *dx,
                                long long dx_bs, const void *ln_w, const void *ln_b, float eps, void *shift,
                                long long shift_bs, const void *mix, int K, void *x_out, long long xo_bs,
                                void *out, long long out_bs, long long out_plane, void *stream) {
    if (B <= 0) return 0;
    if (C % 4 || C / 4 > 1024 * wkv7::LN_VPT) return -1;
    wkv7::LnArgs p{x,     dx,       ln_w, ln_b, mix, shift, x_out, out, x_bs, dx_bs, shift_bs, xo_bs, out_bs,
                   out_plane, C, K, eps, nullptr, nullptr, 0, 0, 0, 0, 0};
    return wkv7::launch_ln(p, f_dt, B, wkv7::ln_fast(p, B), stream);
}

// fused_add_ln_mix with planes q0..K-1 also (or only: keep <= k) as e4m3 codes q (plane stride
// q_plane, row stride q_bs bytes) and fp32 scales qs (plane stride qs_plane): 16-bit f_dt, a mix
// (K >= 1) and a shift, the fast path's layout, q 16-byte aligned with q_bs and q_plane multiples
// of 16 (quant_rows_fp8's cover: elsewhere the caller's fallback is its pure-torch twin, whose
// codes differ on rounding ties). Otherwise -2 and nothing launched (the caller runs
// fused_add_ln_mix and quant_rows_fp8).
extern "C" int fused_add_ln_mix_fp8(int f_dt, int B, int C, const void *x, long long x_bs, const void *dx,
                                    long long dx_bs, const void *ln_w, const void *ln_b, float eps, void *shift,
                                    long long shift_bs, const void *mix, int K, void *x_out, long long xo_bs,
                                    void *out, long long out_bs, long long out_plane, int keep, int q0, void *q,
                                    long long q_bs, long long q_plane, void *qs, long long qs_plane, void *stream) {
    if (B <= 0) return 0;
    if ((f_dt != 1 && f_dt != 2) || !mix || !shift || K < 1 || keep < 0 || keep > K || q0 < 0 || q0 >= K) return -2;
    if (!q || !qs || ((uintptr_t)q & 15) || q_bs % 16 || q_plane % 16) return -2;  // quant_rows_fp8's cover
    wkv7::LnArgs p{x,        dx,   ln_w, ln_b, mix,  shift, x_out, out, x_bs, dx_bs, shift_bs, xo_bs, out_bs,
                   out_plane, C, K, eps, static_cast<uint8_t *>(q), static_cast<float *>(qs), q_bs, q_plane,
                   qs_plane, keep, q0};
    if (!wkv7::ln_fast(p, B)) return -2;
    return wkv7::launch_ln(p, f_dt, B, true, stream);
}

// h: n contiguous elements (8-byte aligned for 16-bit, 16-byte for fp32), in place.
extern "C" int fused_relu_square(int f_dt, void *h, long long n, void *stream) {
    if (n <= 0) return 0;
    long long blocks = (n / 4 + 255) / 256;
    blocks = blocks < 1 ? 1 : (blocks > 8192 ? 8192 : blocks);
    return WKV7_F_DISPATCH(f_dt, {
        return (int)rwkv_pdl::launch_pdl(relu_square_kernel<F>, dim3((int)blocks), dim3(256), 0, (cudaStream_t)stream, (F *)h, n);
    });
}

// a (na elements) <- tanh(a), g (ng elements) <- sigmoid(g), both contiguous, in place.
extern "C" int fused_lora_act(int f_dt, void *a, long long na, void *g, long long ng, void *stream) {
    if (na + ng <= 0) return 0;
    long long blocks = (na + ng + 255) / 256;
    blocks = blocks > 8192 ? 8192 : blocks;
    return WKV7_F_DISPATCH(f_dt, {
        return (int)rwkv_pdl::launch_pdl(lora_act_kernel<F>, dim3((int)blocks), dim3(256), 0, (cudaStream_t)stream, (F *)a, na,
                                         (F *)g, ng);
    });
}

// Programmatic dependent launch (pdl.cuh), a test hook: mode 0 = plain launches (what GPUs before
// sm_90 get), 1 = PDL where supported (the default), -1 = leave as is. Returns whether launches on
// the current device used PDL before the call.
extern "C" int pdl_mode(int mode) {
    const int was = rwkv_pdl::pdl_enabled() ? 1 : 0;
    if (mode == 0 || mode == 1) rwkv_pdl::pdl_switch() = mode;
    return was;
}
