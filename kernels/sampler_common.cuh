// Fused sampler (kernels/sampler.cu, whose header documents the algorithm): the shared pieces --
// constants, the kernel arguments (Args), the per-cluster-size config (Cfg, SharedT), the load
// pass (load_row: logits and penalties into shared memory, scalar or in 4-token vectors), the
// warp shuffles and the cluster reduction (cl_reduce), the row view (Row) with its fixed-point
// weights, and two small device helpers (the splitmix64 random stream, the L2 bulk prefetch).
#pragma once
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace cg = cooperative_groups;

namespace sampler_k {

constexpr int THREADS = 1024;
constexpr int NW = THREADS / 32;
static_assert(NW == 32, "one warp reduces the warp partials; 32 chunks of bins");
constexpr int MAX_LOCAL = 16384;  // tokens per CTA of a 4- or 8-CTA cluster (z + key: 128 KiB)
constexpr int UNSUPPORTED = -2;
constexpr int NONFINITE_TOKEN = -3;  // a row with no finite z (server.engine.types.NONFINITE_TOKEN)
constexpr float FIX46 = 70368744177664.0f;   // 2^46: p and w fixed-point unit
constexpr float FIX47 = 140737488355328.0f;  // 2^47: exp(z - m) fixed-point unit (S)

typedef unsigned long long u64;

struct Args {
    const void *logits;     // (B, V) fp32 / fp16 / bf16 (lg_dt 0 / 1 / 2): the head's own output
    long long lg_s;
    float *penalty;
    long long pen_s;
    unsigned char *seen;
    long long seen_s;
    const float *fparams;   // (B, 5) temperature, top_p, presence, repetition, decay
    const long long *iparams;  // (B, 2) top_k, seed
    const long long *pos;   // (B,)
    const unsigned char *commit;  // (B,) bool
    long long *out;         // (B,) tokens
    float *dbg;             // (B, 8) or null
    int greedy_only, V, n_loc, lg_dt;
    int B, prefetch;        // rows; 1: ask the L2 for the cluster's next row during this one
    int vec;                // 1: every CTA's slice of the logits / penalty rows is 16-byte aligned (load pass
                            // in 4-token vectors); set by the launcher from the pointers, strides and n_loc
};

template <int BINS>
struct alignas(16) SharedT {
    unsigned hcnt[2][BINS], hlo[2][BINS], hhi[2][BINS];  // local histograms (2 slots: see hs)
    u64 cw[BINS];                                         // combined weight / mass per bin
    unsigned cc[BINS];                                    // combined count per bin
    u64 chw[32];                                          // per chunk of nb / 32 bins: weight
    unsigned chc[32];                                     // and count
    alignas(16) unsigned char wraw[NW * 32];              // per-warp partials
    alignas(16) unsigned char xraw[2][32];                // cluster exchange slots
    alignas(16) unsigned char sraw[NW * 16];              // block scan scratch
    alignas(16) unsigned char rraw[64];                   // broadcast (select result, scan total)
};

// Per cluster size: 4 CTAs (V <= 65536) or 8 (V <= 131072) with 11-bit radix digits; 3 CTAs
// (V <= 65544, the large-batch shape: a 3-CTA cluster fits every SM of a GPC where 4-CTA ones
// leave some idle) with 10-bit digits, so a third of the row (175 KiB) fits beside the histograms.
// The digits only narrow the searches: every shape gives the same results.
template <int CL>
struct Cfg {
    static constexpr int DIGIT = CL == 3 ? 10 : 11;  // radix digit bits (at most)
    static constexpr int BINS = 1 << DIGIT;
    static constexpr int MAX_LOCAL = CL == 3 ? 21848 : sampler_k::MAX_LOCAL;  // tokens per CTA (a multiple of 4)
    using Shared = SharedT<BINS>;
};

struct MaxArg { float v; int i; };

__device__ __forceinline__ float load_logit(const void *lg, int dt, long long i) {
    if (dt == 1) return __half2float(__ldg(static_cast<const __half *>(lg) + i));
    if (dt == 2) return __bfloat162float(__ldg(static_cast<const __nv_bfloat16 *>(lg) + i));
    return __ldg(static_cast<const float *>(lg) + i);
}
// Logits i .. i + 3 widened to fp32 (i a multiple of 4 and the row 16-byte aligned: one 8- or
// 16-byte load).
__device__ __forceinline__ float4 load_logit4(const void *lg, int dt, long long i) {
    if (dt == 0) return __ldg(reinterpret_cast<const float4 *>(static_cast<const float *>(lg) + i));
    const uint2 u = __ldg(reinterpret_cast<const uint2 *>(static_cast<const unsigned short *>(lg) + i));
    float2 lo, hi;
    if (dt == 1) {
        lo = __half22float2(*reinterpret_cast<const __half2 *>(&u.x));
        hi = __half22float2(*reinterpret_cast<const __half2 *>(&u.y));
    } else {
        lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(&u.x));
        hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(&u.y));
    }
    return make_float4(lo.x, lo.y, hi.x, hi.y);
}
__device__ __forceinline__ void max_at(MaxArg &mx, float z, int i) {
    if (z > mx.v || (z == mx.v && i < mx.i)) mx = {z, i};  // first index of the max
}

__device__ __forceinline__ void load_one(const Args &a, long long lg0, float *pen, float *zs, int base, int i,
                                         bool decayed, float decay, MaxArg &mx) {
    const float p = pen[i];
    const float z = load_logit(a.logits, a.lg_dt, lg0 + i) - p;
    zs[i] = z;
    if (decayed && p != 0.f) pen[i] = p * decay;
    max_at(mx, z, base + i);
}

// The load pass of one CTA's slice [base, base + cnt) of a row: z = logit - penalty (exact
// widening, as logits.float()) into zs; the penalty decayed in place (decayed: commit rows whose
// decay is not 1; a zero penalty stays zero, so it is not rewritten: most of the row is zero);
// returns this thread's (max z, first index). a.vec: 4 tokens per load (one 16-byte penalty load,
// one 8- or 16-byte logit load), the last cnt % 4 one at a time.
__device__ __forceinline__ MaxArg load_row(const Args &a, long long lg0, float *pen, float *zs, int base, int cnt,
                                           bool decayed, float decay) {
    MaxArg mx{-INFINITY, 0x7fffffff};
    if (a.vec) {
        const int n4 = cnt & ~3;
#pragma unroll 2
        for (int i = 4 * threadIdx.x; i < n4; i += 4 * THREADS) {
            const float4 p = *reinterpret_cast<const float4 *>(pen + i);
            const float4 l = load_logit4(a.logits, a.lg_dt, lg0 + i);
            const float4 z = make_float4(l.x - p.x, l.y - p.y, l.z - p.z, l.w - p.w);
            *reinterpret_cast<float4 *>(zs + i) = z;
            if (decayed && (p.x != 0.f || p.y != 0.f || p.z != 0.f || p.w != 0.f))
                *reinterpret_cast<float4 *>(pen + i) = make_float4(p.x * decay, p.y * decay, p.z * decay, p.w * decay);
            max_at(mx, z.x, base + i), max_at(mx, z.y, base + i + 1);
            max_at(mx, z.z, base + i + 2), max_at(mx, z.w, base + i + 3);
        }
        if ((int)threadIdx.x < cnt - n4) load_one(a, lg0, pen, zs, base, n4 + threadIdx.x, decayed, decay, mx);
        return mx;
    }
#pragma unroll 4
    for (int i = threadIdx.x; i < cnt; i += THREADS) load_one(a, lg0, pen, zs, base, i, decayed, decay, mx);
    return mx;
}

struct MinTok { int i; float z; unsigned kmin; };
struct CW { unsigned c; u64 w; };

__device__ __forceinline__ float shfl_x(float v, int o) { return __shfl_xor_sync(0xffffffffu, v, o); }
__device__ __forceinline__ int shfl_x(int v, int o) { return __shfl_xor_sync(0xffffffffu, v, o); }
__device__ __forceinline__ unsigned shfl_x(unsigned v, int o) { return __shfl_xor_sync(0xffffffffu, v, o); }
__device__ __forceinline__ u64 shfl_x(u64 v, int o) { return __shfl_xor_sync(0xffffffffu, v, o); }
__device__ __forceinline__ MaxArg shfl_x(MaxArg v, int o) { return {shfl_x(v.v, o), shfl_x(v.i, o)}; }
__device__ __forceinline__ MinTok shfl_x(MinTok v, int o) { return {shfl_x(v.i, o), shfl_x(v.z, o), shfl_x(v.kmin, o)}; }

struct OpMaxArg {  // larger value; equal values: smaller index (first index of the max)
    __device__ MaxArg operator()(MaxArg a, MaxArg b) const {
        return (b.v > a.v || (b.v == a.v && b.i < a.i)) ? b : a;
    }
};
struct OpMinTok {
    __device__ MinTok operator()(MinTok a, MinTok b) const {
        MinTok r = b.i < a.i ? b : a;
        r.kmin = min(a.kmin, b.kmin);
        return r;
    }
};
struct OpSum {
    __device__ u64 operator()(u64 a, u64 b) const { return a + b; }
};

// Reduce v over the cluster (the same result in every thread of every CTA). The operators are
// commutative and associative (integer sums, min / max with a unique tie-break; the max-z
// values are never NaN), so the reduction order (shuffle trees) does not change the result.
// The exchange slots rotate (xs): a slot is rewritten two reductions later, after another
// cluster.sync that every CTA reaches only once it has read this one.
template <int CL, class T, class F>
__device__ T cl_reduce(cg::cluster_group &cl, typename Cfg<CL>::Shared &sh, int &xs, T v, F f) {
    T *wbuf = reinterpret_cast<T *>(sh.wraw);
    T *xbuf = reinterpret_cast<T *>(sh.xraw[xs]);
#pragma unroll
    for (int o = 16; o; o >>= 1) v = f(v, shfl_x(v, o));
    if ((threadIdx.x & 31) == 0) wbuf[threadIdx.x >> 5] = v;
    __syncthreads();
    if (threadIdx.x < 32) {  // warp 0: a shuffle tree over the NW = 32 warp partials
        T a = wbuf[threadIdx.x];
#pragma unroll
        for (int o = 16; o; o >>= 1) a = f(a, shfl_x(a, o));
        if (threadIdx.x == 0) *xbuf = a;
    }
    cl.sync();
    T r = *cl.map_shared_rank(xbuf, 0);
#pragma unroll
    for (int j = 1; j < CL; j++) r = f(r, *cl.map_shared_rank(xbuf, j));
    xs ^= 1;
    return r;
}

struct Row {
    float *z;  // z, then (from sample_walk on) the fp32 weight w of every token with key >= kthr
    const unsigned *key;
    int cnt, base;
    float ztop, T;
};

// The weight of a kept token: computed once from z by sample_walk (which stores it in place of z:
// z is not needed after that) and read back by its walk (same float, so the same fixed-point
// value as recomputing it).
__device__ __forceinline__ float weight_of(const Row &r, float z) {
    return fminf(expf(__fdiv_rn(z - r.ztop, r.T)), 1.9f);
}
__device__ __forceinline__ u64 fix_f(float w) { return __float2ull_rz(w * FIX46); }
// Fixed-point weight of a kept token (cached) / mass of p (radix_select's MASS).
__device__ __forceinline__ u64 fix_w(const Row &r, int i) { return fix_f(r.z[i]); }
__device__ __forceinline__ u64 fix_p(unsigned k) { return __float2ull_rz(__uint_as_float(k) * FIX46); }

__device__ __forceinline__ u64 splitmix64(u64 x) {
    u64 z = x + 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// Asks the L2 for [p, p + bytes) rounded inwards to 16 bytes (sm_90 bulk prefetch: no registers,
// no wait; nothing on older GPUs), in 4 KiB pieces over the 32 lanes of the calling warp.
__device__ __forceinline__ void prefetch_l2(const void *p, long long bytes, int lane) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const uintptr_t b = ((uintptr_t)p + 15) & ~(uintptr_t)15, e = ((uintptr_t)p + bytes) & ~(uintptr_t)15;
    for (uintptr_t q = b + (uintptr_t)lane * 4096; q < e; q += 32 * 4096) {
        const unsigned n = (unsigned)(e - q < 4096 ? e - q : 4096);
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(q), "r"(n) : "memory");
    }
#endif
}

}  // namespace sampler_k
