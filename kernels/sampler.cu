// Fused sampler step: one launch does what server.engine.sampler.sample() does for every row
// (penalised logits, greedy argmax or softmax -> top-p -> top-k -> temperature -> inverse CDF
// with the (seed, pos) counter random, then the penalty / seen update of committing rows).
// Pure-torch twin (the reference): server.engine.sampler.sample with CANDIDATES = () (a stable
// full sort of every row). Wrapper: server.model.cuda_ops.fused_sample.
//
// Layout: one thread-block CLUSTER of CL CTAs (1024 threads each) per row; CTA r of the cluster
// owns tokens [r*n_loc, (r+1)*n_loc) and keeps them in shared memory for the whole step:
// z = logits - penalty (fp32) and key = the fp32 bits of p = softmax(z) (p >= 0, so the bits
// order like the values). CL = 4 for V <= 65536 (128 KiB of z + keys per CTA), 8 up to 131072.
// Cross-CTA reductions and histograms go through distributed shared memory (cluster.sync).
// The step is latency bound (one 1024-thread CTA per SM; ~10x above its memory time), so the
// code keeps the barriers per radix pass to one cluster.sync + one __syncthreads, and no phase
// has one warp working serially while the others wait (see radix_select, cl_reduce).
//
// Exact by construction (no candidate limit): the canonical order is (p descending, id
// ascending), as a stable full sort. Every threshold is found by a radix select over the 31-bit
// keys (<= 3 passes of <= 11-bit digits below the common prefix of the range; histograms of count + 64-bit fixed-point
// mass, combined over the cluster), and ties inside one p value are walked in id order by a
// block + cluster prefix scan. Steps for a sampled row (T > 0):
//   1. m = max z (argmax: first index of the max, as torch.argmax); greedy rows stop here.
//   2. S = sum exp(z - m) as an exact fixed-point sum (2^-47 units, order independent), rounded
//      once to fp32; p_i = expf(z_i - m) / S (IEEE division), the same formula as torch.softmax
//      (exp(x - max) / sum) except that torch's fp32 S is summed in its own order.
//   3. top-p: c* = the p value with mass(p > c*) < top_p <= mass(p >= c*) (masses are exact sums
//      of the fp32 p values in 2^-46 units): what the reference's first rank with cum >= top_p
//      gives in exact arithmetic. top_p >= 1 keeps every token (the reference may cut a tail
//      whose fp32 cumsum already reached 1.0); mass < top_p everywhere keeps every token (the
//      reference's clamp); top_p <= 0 (or NaN) keeps the maximum's tie group.
//   4. top-k (0 < k < n kept): the k-th largest key k*, all tokens with p > k*, and the first
//      k - count(p > k*) tokens with p == k* in id order.
//   5. weights w = expf((z - z_top) / T) (z_top = z of the rank-0 token), exact fixed-point sums
//      (2^-46 units; w is computed once per kept token, by the first walk, and stored over z);
//      t = u * W in double (u = uniform(seed, pos), bit-exact splitmix64 stream);
//      the token = first canonical rank whose cumulative weight > t (radix select on the keys,
//      then the id-order walk inside the p-group that holds the crossing).
//   6. commit rows: penalty *= decay (written in the load pass, z is kept in shared memory),
//      penalty[t] += seen[t] ? repetition : presence, seen[t] = 1.
// Where this can differ from the reference (all near ties, see test_sampler_kernel_gpu.py):
//   * S: torch sums exp in fp32 in its own order, so S (hence some p) may differ by an ulp;
//   * cum / cdf: the reference's fp32 cumsums carry rounding (~1e-7 * sqrt(n) relative); the
//     kernel's sums are exact, so a top-p or inverse-CDF boundary within that error can flip;
//   * top_p >= 1 (above); NaN logits (unspecified here); w clamped to <= 1.9 (only reachable
//     with z_top < z_max by an expf tie and a tiny T).
// Deterministic: every sum is an integer sum, so the result does not depend on the launch,
// the batch, or the cluster split (a row gives the same token alone or in any batch).
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace cg = cooperative_groups;

namespace sampler_k {

constexpr int UNSUPPORTED = -2;
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
};

struct MaxArg { float v; int i; };

__device__ __forceinline__ float load_logit(const void *lg, int dt, long long i) {
    if (dt == 1) return __half2float(__ldg(static_cast<const __half *>(lg) + i));
    if (dt == 2) return __bfloat162float(__ldg(static_cast<const __nv_bfloat16 *>(lg) + i));
    return __ldg(static_cast<const float *>(lg) + i);
}
struct MinTok { int i; float z; unsigned kmin; };
struct CW { unsigned c; u64 w; };
struct Walk { u64 wgt, wgrp; int found, last; };

__device__ __forceinline__ float shfl_x(float v, int o) { return __shfl_xor_sync(0xffffffffu, v, o); }
__device__ __forceinline__ int shfl_x(int v, int o) { return __shfl_xor_sync(0xffffffffu, v, o); }
__device__ __forceinline__ unsigned shfl_x(unsigned v, int o) { return __shfl_xor_sync(0xffffffffu, v, o); }
__device__ __forceinline__ u64 shfl_x(u64 v, int o) { return __shfl_xor_sync(0xffffffffu, v, o); }
__device__ __forceinline__ MaxArg shfl_x(MaxArg v, int o) { return {shfl_x(v.v, o), shfl_x(v.i, o)}; }
__device__ __forceinline__ MinTok shfl_x(MinTok v, int o) { return {shfl_x(v.i, o), shfl_x(v.z, o), shfl_x(v.kmin, o)}; }
__device__ __forceinline__ Walk shfl_x(Walk v, int o) {
    return {shfl_x(v.wgt, o), shfl_x(v.wgrp, o), shfl_x(v.found, o), shfl_x(v.last, o)};
}

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
struct OpWalk {
    __device__ Walk operator()(Walk a, Walk b) const {
        return {a.wgt + b.wgt, a.wgrp + b.wgrp, min(a.found, b.found), min(a.last, b.last)};
    }
};

struct Row {
    float *z;  // z, then (from the first group_walk on) the fp32 weight w of every token with key >= kthr
    const unsigned *key;
    int cnt, base;
    float ztop, T;
};

// The weight of a kept token: computed once from z by the first group_walk (which stores it in
// place of z: z is not needed after that), read back by the later passes (same float, so the
// same fixed-point value as recomputing it).
__device__ __forceinline__ float weight_of(const Row &r, float z) {
    return fminf(expf(__fdiv_rn(z - r.ztop, r.T)), 1.9f);
}
__device__ __forceinline__ u64 fix_f(float w) { return __float2ull_rz(w * FIX46); }
// Fixed-point weight of a kept token (mode 2; cached) / mass of p (mode 1).
__device__ __forceinline__ u64 fix_w(const Row &r, int i) { return fix_f(r.z[i]); }
__device__ __forceinline__ u64 fix_p(unsigned k) { return __float2ull_rz(__uint_as_float(k) * FIX46); }

struct Sel {
    unsigned key, cnt_above, cnt_at;
    u64 w_above;
    int found;
};

enum { COUNT = 0, MASS = 1, WEIGHT = 2 };

__device__ __forceinline__ u64 splitmix64(u64 x) {
    u64 z = x + 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

namespace cta1024 {  // one 1024-thread CTA per SM, 4-CTA clusters (8 for V > 65536)
#define SAMPLER_THREADS 1024
#define SAMPLER_DIGIT 11
#define SAMPLER_MIN_BLOCKS 1
#include "sampler_core.cuh"
#undef SAMPLER_THREADS
#undef SAMPLER_DIGIT
#undef SAMPLER_MIN_BLOCKS
}  // namespace cta1024

namespace cta512 {  // two 512-thread CTAs per SM, 8-CTA clusters (V <= 65536): at large batch two
                    // rows' barriers and latencies overlap on every SM
#define SAMPLER_THREADS 512
#define SAMPLER_DIGIT 10
#define SAMPLER_MIN_BLOCKS 2
#include "sampler_core.cuh"
#undef SAMPLER_THREADS
#undef SAMPLER_DIGIT
#undef SAMPLER_MIN_BLOCKS
}  // namespace cta512

}  // namespace sampler_k

// One sampler step for rows [0, B). logits (B, V) fp32 / fp16 / bf16 (lg_dt 0 / 1 / 2) rows lg_s apart; penalty (B, V) fp32
// rows pen_s apart (updated); seen (B, V) bool rows seen_s apart (updated); fparams (B, 5) fp32,
// iparams (B, 2) int64, positions (B,) int64, commit (B,) bool: contiguous; out (B,) int64;
// dbg: null or (B, 8) fp32 (m, S, c*, n kept by top-p, top-k threshold, its group limit,
// total weight, target). cta: the CTA shape, 1024 (one CTA per SM, 4-CTA clusters; 8 for V >
// 65536) or 512 (two per SM, 8-CTA clusters, V <= 65536; else as 1024); 0 = 1024. The results do
// not depend on it. Returns 0, a CUDA error, or -2 (V or cta not covered: use the torch path).
extern "C" int sampler_step(void *logits, long long lg_s, void *penalty, long long pen_s, void *seen,
                            long long seen_s, void *fparams, void *iparams, void *positions, void *commit,
                            int greedy_only, int B, int V, void *out, void *dbg, int lg_dt, int cta, void *stream) {
    using namespace sampler_k;
    if (B <= 0) return 0;
    if (V <= 0 || V > 8 * cta1024::MAX_LOCAL) return UNSUPPORTED;
    if (lg_dt < 0 || lg_dt > 2) return UNSUPPORTED;
    Args a{logits, lg_s, static_cast<float *>(penalty), pen_s,
           static_cast<unsigned char *>(seen), seen_s, static_cast<const float *>(fparams),
           static_cast<const long long *>(iparams), static_cast<const long long *>(positions),
           static_cast<const unsigned char *>(commit), static_cast<long long *>(out), static_cast<float *>(dbg),
           greedy_only, V, 0, lg_dt};
    cudaStream_t st = static_cast<cudaStream_t>(stream);
    if (cta != 0 && cta != 512 && cta != 1024) return UNSUPPORTED;
    if (cta == 512 && V <= 8 * cta512::MAX_LOCAL) {
        a.n_loc = (V + 7) / 8;
        return cta512::launch<8>(a, B, st);
    }
    if (V <= 4 * cta1024::MAX_LOCAL) {
        a.n_loc = (V + 3) / 4;
        return cta1024::launch<4>(a, B, st);
    }
    a.n_loc = (V + 7) / 8;
    return cta1024::launch<8>(a, B, st);
}
