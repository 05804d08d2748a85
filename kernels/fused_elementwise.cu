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
//            dx_rs: dx = (dx * (dx_rs[b] * dx_mul)) * dx_cs[c] in fp32 first (an fp8 product whose
//            per-row and per-column scales are applied here: server.model.qlinear.ScaledProduct)
//     xn   = round(layer_norm(x') * w + b)     (eps, biased variance, as F.layer_norm)
//     prev = shift; shift = xn                 (when shift: the token-shift state, in place)
//     K == 0: out = xn                         K > 0: d = round(prev - xn),
//                                                     out[k] = round(xn + d * mix[k])  (k < K)
// relu_square: h = round(max(h, 0)^2) in place.
// lora_act: a = tanh(a), g = sigmoid(g) in place (two buffers, one launch).
#include <cuda_fp8.h>

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
    const float *dx_rs, *dx_cs;  // null, or dx's per-row (B,) and per-column (C,) scales
    float dx_mul;                // with them: a power of two folded into the row scale
    // fused_add_ln_mix_q only: the last NQ planes as e4m3 codes (plane j at q + j * q_plane, rows
    // q_bs bytes apart) with fp32 scales (q_scale[j * q_sp + b]); planes k < q_keep also in F
    void *q;
    float *q_scale;
    long long q_bs, q_plane, q_sp;
    int q_keep;
};

// dx's scale for row b (only when dx carries scales: p.dx_rs set)
__device__ __forceinline__ float dx_row_scale(const LnArgs &p, int b) { return p.dx_rs[b] * p.dx_mul; }

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
                if (p.dx_rs) {
                    const float rs = dx_row_scale(p, b);
#pragma unroll
                    for (int e = 0; e < 4; e++) d[e] = d[e] * rs * p.dx_cs[c + e];
                }
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

// A quantized plane's 8 values of this thread: rounded to F (the bits an F plane would hold),
// packed into h, their absolute maximum into amax.
template <typename F>
__device__ __forceinline__ void hold_plane(const float *o, uint4 &h, float &amax) {
    h = make_uint4(pack2<F>(o[0], o[1]), pack2<F>(o[2], o[3]), pack2<F>(o[4], o[5]), pack2<F>(o[6], o[7]));
    float r[LN_VW];
    cvt4(make_uint2(h.x, h.y), (const F *)nullptr, r);
    cvt4(make_uint2(h.z, h.w), (const F *)nullptr, r + 4);
#pragma unroll
    for (int e = 0; e < LN_VW; e++) amax = fmaxf(amax, fabsf(r[e]));
}

// The NQ quantized planes of row b as quant.cu's quant_rows_fp8 would make them from the F planes:
// the row's absolute maximum m (a block reduction per plane), scale m / 448 (1 for a zero row),
// codes sat_e4m3(value * (448 / m)) rounded to nearest even. Every thread of the block calls it.
template <typename F, int NQ>
__device__ __forceinline__ void store_e4m3(const LnArgs &p, int b, int c, bool act, const uint4 (&qv)[NQ],
                                           float (&qmax)[NQ]) {
    constexpr float FP8_MAX = 448.f;
    __shared__ float qred[NQ][32];
    const int wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
    for (int j = 0; j < NQ; j++) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) qmax[j] = fmaxf(qmax[j], __shfl_xor_sync(0xffffffffu, qmax[j], o));
        if ((threadIdx.x & 31) == 0) qred[j][wid] = qmax[j];
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < NQ; j++) {
        float m = qred[j][0];
        for (int i = 1; i < nw; i++) m = fmaxf(m, qred[j][i]);
        const float inv = m > 0.f ? FP8_MAX / m : 1.f;
        if (threadIdx.x == 0) p.q_scale[j * p.q_sp + b] = m > 0.f ? m / FP8_MAX : 1.f;
        if (!act) continue;
        float r[LN_VW];
        cvt4(make_uint2(qv[j].x, qv[j].y), (const F *)nullptr, r);
        cvt4(make_uint2(qv[j].z, qv[j].w), (const F *)nullptr, r + 4);
        uint16_t cd[4];
#pragma unroll
        for (int i = 0; i < 4; i++)
            cd[i] = __nv_cvt_float2_to_fp8x2(make_float2(r[2 * i] * inv, r[2 * i + 1] * inv), __NV_SATFINITE, __NV_E4M3);
        uint8_t *dst = (uint8_t *)p.q + j * p.q_plane + b * p.q_bs + c;
        *reinterpret_cast<uint2 *>(dst) = make_uint2(cd[0] | (uint32_t)cd[1] << 16, cd[2] | (uint32_t)cd[3] << 16);
    }
}

// Launch bound of 1 block per SM: ptxas uses 76-80 registers (no spills), and 2 blocks of 320
// threads (C = 2560) still fit per SM. A bound of 2 would cap it at 64 registers with spills (a
// slower decode step: docs/performance.md).
// HOLD (16-bit F): the mix rows are read with the LN weights before the PDL wait and held in
// registers (76-80 of them), off the row's path. HOLD = false reads them after the reduction: 54
// registers, 3 blocks of 320 threads per SM instead of 2, more rows in flight for a kernel that
// waits on memory latency. The launcher takes it only where that means fewer waves of blocks
// (2.9B: B=1,024 runs 3 waves instead of 4; at B=512 both run 2, and the held rows win).
// KC, NQ (fused_add_ln_mix_q, 16-bit F only): K = KC planes, of which the last NQ come out as
// e4m3 codes (store_e4m3) and only planes k < q_keep in F; KC = 0: p.K planes, all in F.
template <typename F, bool HOLD, int KC = 0, int NQ = 0>
__global__ void __launch_bounds__(LN_V2_THREADS, 1) add_ln_mix_v2_kernel(LnArgs p) {
    static_assert(NQ == 0 || (KC > 0 && NQ <= KC && sizeof(F) == 2), "quantized planes: 16-bit F, KC planes");
    constexpr int QF = KC - NQ;  // the first quantized plane
    __shared__ float red[3][32];
    const int b = blockIdx.x, tid = threadIdx.x;
    const int K = KC ? KC : p.K;
    const int c = LN_VW * tid;
    const bool act = c < p.C;
    const bool has_dx = p.dx != nullptr, has_shift = p.shift != nullptr;
    float v[LN_VW], d[LN_VW], w[LN_VW], bb[LN_VW], prev[LN_VW];
    // every load first (no store can alias them: each thread writes only its own columns). The
    // mix rows stay packed (16-bit: 4 registers per row; fp32 compute reads them after the
    // reduction): 76 registers, 2 blocks of 320 threads per SM (at 107 registers, with the mixes
    // unpacked to fp32, only one fit). The weights (LN w / b, mix rows) go out before the wait
    // for the predecessor (pdl.cuh); x, dx and the shift state after it.
    constexpr bool EARLY = HOLD && sizeof(F) == 2;
    uint4 mraw[LN_KMAX];
    auto load_weights = [&] {
        load8<F>((const F *)p.ln_w + c, w);
        load8<F>((const F *)p.ln_b + c, bb);
        if constexpr (EARLY) {
#pragma unroll
            for (int k = 0; k < LN_KMAX; k++)
                if (k < K) mraw[k] = *reinterpret_cast<const uint4 *>((const F *)p.mix + (long long)k * p.C + c);
        }
    };
    if (act) load_weights();
    rwkv_pdl::pdl_wait();
    rwkv_pdl::pdl_trigger();
    if (act) {
        load8<F>((const F *)p.x + b * p.x_bs + c, v);
        if (has_dx) load8<F>((const F *)p.dx + b * p.dx_bs + c, d);
        if (has_shift) load8<F>((const F *)p.shift + b * p.shift_bs + c, prev);
    }
    // residual add and this thread's (count, mean, M2)
    float n = 0.f, mean = 0.f, m2 = 0.f;
    if (act) {
        if (has_dx && p.dx_rs) {  // the column scales after the wait: they share dx's live range
            const float rs = dx_row_scale(p, b);
            const float4 c0 = *reinterpret_cast<const float4 *>(p.dx_cs + c);
            const float4 c1 = *reinterpret_cast<const float4 *>(p.dx_cs + c + 4);
            const float cs[LN_VW] = {c0.x, c0.y, c0.z, c0.w, c1.x, c1.y, c1.z, c1.w};
#pragma unroll
            for (int e = 0; e < LN_VW; e++) d[e] = d[e] * rs * cs[e];
        }
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
    const int wid = tid >> 5, nw = blockDim.x >> 5;
    if ((tid & 31) == 0) red[0][wid] = n, red[1][wid] = mean, red[2][wid] = m2;
    __syncthreads();
    n = red[0][0], mean = red[1][0], m2 = red[2][0];
    for (int i = 1; i < nw; i++) chan_combine(n, mean, m2, red[0][i], red[1][i], red[2][i]);
    if (!act && NQ == 0) return;  // (with quantized planes every thread takes store_e4m3's barrier)
    const float rstd = rsqrtf(m2 / p.C + p.eps);
    uint4 qv[NQ ? NQ : 1];     // the quantized planes' values, rounded to F and packed
    float qmax[NQ ? NQ : 1] = {};  // and their absolute maxima over this thread's columns
    if (act) {
        if (has_dx) store8<F>((F *)p.x_out + b * p.xo_bs + c, v);
        float xn[LN_VW];
#pragma unroll
        for (int e = 0; e < LN_VW; e++) xn[e] = rnd<F>((v[e] - mean) * rstd * w[e] + bb[e]);
        if (has_shift) {
            store8<F>((F *)p.shift + b * p.shift_bs + c, xn);
#pragma unroll
            for (int e = 0; e < LN_VW; e++) d[e] = rnd<F>(prev[e] - xn[e]);
        } else {
#pragma unroll
            for (int e = 0; e < LN_VW; e++) d[e] = 0.f;
        }
        F *out = (F *)p.out + b * p.out_bs + c;
        if (K == 0) {
            store8<F>(out, xn);
        } else {
#pragma unroll
            for (int k = 0; k < LN_KMAX; k++) {
                if (k < K) {
                    float o[LN_VW];
                    if constexpr (EARLY) {
                        cvt4(make_uint2(mraw[k].x, mraw[k].y), (const F *)nullptr, o);
                        cvt4(make_uint2(mraw[k].z, mraw[k].w), (const F *)nullptr, o + 4);
                    } else {
                        load8<F>((const F *)p.mix + (long long)k * p.C + c, o);
                    }
#pragma unroll
                    for (int e = 0; e < LN_VW; e++) o[e] = xn[e] + d[e] * o[e];
                    if constexpr (NQ > 0) {
                        if (k >= QF && k - QF < NQ) hold_plane<F>(o, qv[k - QF], qmax[k - QF]);
                        if (k < p.q_keep) store8<F>(out + k * p.out_plane, o);
                    } else {
                        store8<F>(out + k * p.out_plane, o);
                    }
                }
            }
        }
    }
    if constexpr (NQ > 0) store_e4m3<F, NQ>(p, b, c, act, qv, qmax);
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

// Blocks of add_ln_mix_v2_kernel<F, HOLD> (threads each) resident on the current device at once;
// cached per instantiation, device and block size. A failed query answers "any number" (the
// launcher keeps HOLD).
template <typename F, bool HOLD, int KC = 0, int NQ = 0>
inline int ln_resident(int threads) {
    constexpr int DEVS = 16, SIZES = LN_V2_THREADS / 32 + 1;
    static int cache[DEVS][SIZES] = {};
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || dev >= DEVS || threads / 32 >= SIZES) return 1 << 30;
    int &n = cache[dev][threads / 32];
    if (n == 0) {
        int per = 0;
        const int sms = num_sms();
        if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per, add_ln_mix_v2_kernel<F, HOLD, KC, NQ>, threads, 0) != cudaSuccess ||
            per * sms <= 0)
            return 1 << 30;
        n = per * sms;
    }
    return n;
}

// The fast path's conditions: 16-byte aligned rows of whole 8-column groups, one group per thread.
inline bool ln_fast(const LnArgs &p, int B, const void *x, const void *dx, const void *ln_w, const void *ln_b,
                    const void *mix, const void *shift, const void *x_out, const void *out, const void *dx_cs) {
    auto al16 = [](const void *q) { return ((uintptr_t)q & 15) == 0; };
    const int C = p.C, K = p.K;
    bool fast = C % LN_VW == 0 && C / LN_VW <= LN_V2_THREADS && K <= LN_KMAX;
    fast = fast && al16(x) && al16(dx) && al16(ln_w) && al16(ln_b) && al16(mix) && al16(shift) && al16(x_out) &&
           al16(out) && al16(dx_cs);
    fast = fast && (B == 1 || (p.x_bs % LN_VW == 0 && p.dx_bs % LN_VW == 0 && p.shift_bs % LN_VW == 0 &&
                               p.xo_bs % LN_VW == 0 && p.out_bs % LN_VW == 0));
    return fast && (K <= 1 || p.out_plane % LN_VW == 0);
}

// One block of C / 8 threads per row; HOLD unless the lean kernel's extra resident blocks take a
// wave of rows off.
template <typename F, int KC = 0, int NQ = 0>
inline int launch_ln_v2(const LnArgs &p, int B, void *stream) {
    const int t2 = ((p.C / LN_VW) + 31) / 32 * 32;
    const int rh = ln_resident<F, true, KC, NQ>(t2), rl = ln_resident<F, false, KC, NQ>(t2);
    const bool hold = (B + rh - 1) / rh <= (B + rl - 1) / rl;
    return (int)rwkv_pdl::launch_pdl(hold ? add_ln_mix_v2_kernel<F, true, KC, NQ> : add_ln_mix_v2_kernel<F, false, KC, NQ>,
                                     dim3(B), dim3(t2), 0, (cudaStream_t)stream, p);
}

}  // namespace wkv7

// All tensors in dtype f_dt; rows of C with the given strides (elements); C % 4 == 0; 16-byte
// (fp32) / 8-byte (16-bit) aligned rows. dx, shift may be null; K == 0: out is (B, C), else
// K planes of out_plane elements. Returns a cudaError_t value, or -1 (bad dtype / C too large).
// dx_rs, dx_cs: null, or fp32 scales of dx: per row (B, contiguous) and per column (C, 16-byte
// aligned), applied with dx_mul as in the header.
extern "C" int fused_add_ln_mix(int f_dt, int B, int C, const void *x, long long x_bs, const void *dx,
                                long long dx_bs, const void *ln_w, const void *ln_b, float eps, void *shift,
                                long long shift_bs, const void *mix, int K, void *x_out, long long xo_bs,
                                void *out, long long out_bs, long long out_plane, const void *dx_rs,
                                const void *dx_cs, float dx_mul, void *stream) {
    if (B <= 0) return 0;
    const int nv = C / 4;
    if (C % 4 || nv > 1024 * wkv7::LN_VPT) return -1;
    int threads = ((nv + wkv7::LN_VPT - 1) / wkv7::LN_VPT + 31) / 32 * 32;
    threads = threads < 128 ? 128 : threads;
    if ((dx_rs == nullptr) != (dx_cs == nullptr) || (dx_rs && !dx)) return -1;
    wkv7::LnArgs p{x, dx, ln_w, ln_b, mix, shift, x_out, out, x_bs, dx_bs, shift_bs, xo_bs, out_bs, out_plane,
                   C, K, eps, (const float *)dx_rs, (const float *)dx_cs, dx_mul};
    if (wkv7::ln_fast(p, B, x, dx, ln_w, ln_b, mix, shift, x_out, out, dx_cs))
        return WKV7_F_DISPATCH(f_dt, { return wkv7::launch_ln_v2<F>(p, B, stream); });
    return WKV7_F_DISPATCH(f_dt, {
        return (int)rwkv_pdl::launch_pdl(add_ln_mix_kernel<F>, dim3(B), dim3(threads), 0, (cudaStream_t)stream, p);
    });
}

// fused_add_ln_mix with its last nq planes also as per-row e4m3 codes (those that feed an fp8
// product): (K, nq) = (6, 3) or (1, 1), fp16 / bf16, the fast path's layouts. Planes k < keep are
// written to out as by fused_add_ln_mix (out has keep planes; keep <= K), the quantized ones to q
// (nq planes of q_plane bytes, rows q_bs bytes apart, 8-byte aligned) with fp32 scales q_scale[j *
// B + b]: the codes and scales quant_rows_fp8 makes from those planes in F. Returns -2 (nothing
// launched) for what it does not cover, else a cudaError_t value.
extern "C" int fused_add_ln_mix_q(int f_dt, int B, int C, const void *x, long long x_bs, const void *dx,
                                  long long dx_bs, const void *ln_w, const void *ln_b, float eps, void *shift,
                                  long long shift_bs, const void *mix, int K, int nq, int keep, void *x_out,
                                  long long xo_bs, void *out, long long out_bs, long long out_plane, void *q,
                                  long long q_bs, long long q_plane, void *q_scale, const void *dx_rs,
                                  const void *dx_cs, float dx_mul, void *stream) {
    if (B <= 0) return 0;
    const bool shape = (K == 6 && nq == 3) || (K == 1 && nq == 1);
    if (!shape || keep < 0 || keep > K || !shift || !mix || (f_dt != wkv7::DT_F16 && f_dt != wkv7::DT_BF16)) return -2;
    if ((dx_rs == nullptr) != (dx_cs == nullptr) || (dx_rs && !dx)) return -2;
    if (((uintptr_t)q & 15) || q_bs % 8 || q_plane % 8 || ((uintptr_t)q_scale & 3)) return -2;
    wkv7::LnArgs p{x, dx, ln_w, ln_b, mix, shift, x_out, keep ? out : nullptr, x_bs, dx_bs, shift_bs, xo_bs,
                   out_bs, out_plane, C, K, eps, (const float *)dx_rs, (const float *)dx_cs, dx_mul,
                   q, (float *)q_scale, q_bs, q_plane, (long long)B, keep};
    if (!wkv7::ln_fast(p, B, x, dx, ln_w, ln_b, mix, shift, x_out, keep ? out : nullptr, dx_cs)) return -2;
    auto go = [&](auto f) -> int {
        using F = decltype(f);
        return K == 6 ? wkv7::launch_ln_v2<F, 6, 3>(p, B, stream) : wkv7::launch_ln_v2<F, 1, 1>(p, B, stream);
    };
    return f_dt == wkv7::DT_F16 ? go(__half()) : go(__nv_bfloat16());
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
