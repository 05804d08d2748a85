// Fused sampler step: one launch does what server.engine.sampler.sample() does for every row
// (penalised logits, greedy argmax or softmax -> top-p -> top-k -> temperature -> inverse CDF
// with the (seed, pos) counter random, then the penalty / seen update of committing rows).
// Pure-torch twin (the reference): server.engine.sampler.sample with CANDIDATES = () (a stable
// full sort of every row). Wrapper: server.model.cuda_ops.fused_sample.
//
// Layout: one thread-block CLUSTER of CL CTAs (1024 threads each) per row; CTA r of the cluster
// owns tokens [r*n_loc, (r+1)*n_loc) and keeps them in shared memory for the whole step:
// z = logits - penalty (fp32) and key = the fp32 bits of p = softmax(z) (p >= 0, so the bits
// order like the values). CL = 4 for V <= 65536 (128 KiB of z + keys per CTA), 8 up to 131072;
// CL = 3 for V <= 65538 at large batch (175 KiB per CTA, 10-bit digits: Cfg).
// Cross-CTA reductions and histograms go through distributed shared memory (cluster.sync).
// The grid is at most one wave of clusters (rows_per_wave); a cluster takes rows blockIdx.y,
// + gridDim.y, ... and, once a row's inputs are in shared memory, asks the L2 for its next row's
// logits and penalty (bulk prefetch), so that they stream in during the select phases
// (RWKV_SAMPLER_PERSIST=0: a cluster per row; RWKV_SAMPLER_PREFETCH=0: the loop, no prefetch).
// The step is latency bound (one 1024-thread CTA per SM; ~10x above its memory time), so the
// code keeps the barriers per radix pass to one cluster.sync + one __syncthreads, and no phase
// has one warp working serially while the others wait (see radix_select, cl_reduce).
//
// Exact by construction (no candidate limit): the canonical order is (p descending, id
// ascending), as a stable full sort. Every threshold is found by a radix select over the 31-bit
// keys (<= 3 passes of <= 11-bit digits, 10-bit with 3-CTA clusters, below the common prefix of
// the range; histograms of count + 64-bit fixed-point mass, combined over the cluster), and ties
// inside one p value are walked in id order by a block + cluster prefix scan. Steps for a sampled row (T > 0):
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
#include <stdlib.h>

namespace cg = cooperative_groups;

namespace sampler_k {

constexpr int THREADS = 1024;
constexpr int NW = THREADS / 32;
static_assert(NW == 32, "one warp reduces the warp partials; 32 chunks of bins");
constexpr int MAX_LOCAL = 16384;  // tokens per CTA of a 4- or 8-CTA cluster (z + key: 128 KiB)
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
    int B, prefetch;        // rows; 1: ask the L2 for the cluster's next row during this one
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
// (V <= 65538, the large-batch shape: a 3-CTA cluster fits every SM of a GPC where 4-CTA ones
// leave some idle) with 10-bit digits, so a third of the row (175 KiB) fits beside the histograms.
// The digits only narrow the searches: every shape gives the same results.
template <int CL>
struct Cfg {
    static constexpr int DIGIT = CL == 3 ? 10 : 11;  // radix digit bits (at most)
    static constexpr int BINS = 1 << DIGIT;
    static constexpr int MAX_LOCAL = CL == 3 ? 21846 : sampler_k::MAX_LOCAL;  // tokens per CTA
    using Shared = SharedT<BINS>;
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

// Exclusive block scan of (count, weight) in thread order; returns this thread's offset and
// the block total (in *tot).
template <class Shared>
__device__ CW block_scan(Shared &sh, CW v, CW *tot) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    CW inc = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        unsigned c = __shfl_up_sync(0xffffffffu, inc.c, o);
        u64 x = __shfl_up_sync(0xffffffffu, inc.w, o);
        if (lane >= o) inc.c += c, inc.w += x;
    }
    CW *s = reinterpret_cast<CW *>(sh.sraw);
    if (lane == 31) s[w] = inc;
    __syncthreads();
    if (w == 0) {
        CW t = s[lane], ti = t;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            unsigned c = __shfl_up_sync(0xffffffffu, ti.c, o);
            u64 x = __shfl_up_sync(0xffffffffu, ti.w, o);
            if (lane >= o) ti.c += c, ti.w += x;
        }
        s[lane] = {ti.c - t.c, ti.w - t.w};  // exclusive warp offsets
        if (lane == 31) *reinterpret_cast<CW *>(sh.rraw) = ti;  // block total
    }
    __syncthreads();
    CW off = s[w];
    *tot = *reinterpret_cast<CW *>(sh.rraw);
    // no trailing barrier: the caller (group_walk) reaches a cluster.sync before anything
    // rewrites s / rraw
    return {off.c + inc.c - v.c, off.w + inc.w - v.w};
}

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

// Cluster-combined bins [b0, b0 + NB) (NB = 1 or 2 consecutive bins) of histogram slot (hc, hl,
// hh) into cc / cw; returns their count / weight totals.
template <int CL, int NB>
__device__ __forceinline__ CW combine_bins(cg::cluster_group &cl, typename Cfg<CL>::Shared &sh, const unsigned *hc,
                                           const unsigned *hl, const unsigned *hh, int b0, int mode) {
    unsigned c[NB] = {};
    u64 w[NB] = {};
#pragma unroll
    for (int j = 0; j < CL; j++) {
        const unsigned *rc = cl.map_shared_rank(hc, j);
        if (NB == 2) {
            const uint2 x = *reinterpret_cast<const uint2 *>(rc + b0);
            c[0] += x.x, c[NB - 1] += x.y;
        } else {
            c[0] += rc[b0];
        }
        if (mode != COUNT) {
            const unsigned *rl = cl.map_shared_rank(hl, j), *rh = cl.map_shared_rank(hh, j);
            if (NB == 2) {
                const uint2 l = *reinterpret_cast<const uint2 *>(rl + b0);
                const uint2 h = *reinterpret_cast<const uint2 *>(rh + b0);
                w[0] += ((u64)h.x << 32) + l.x, w[NB - 1] += ((u64)h.y << 32) + l.y;
            } else {
                w[0] += ((u64)rh[b0] << 32) + rl[b0];
            }
        }
    }
    CW t{0u, 0ull};
#pragma unroll
    for (int e = 0; e < NB; e++) {
        if (mode == COUNT) w[e] = c[e];
        sh.cc[b0 + e] = c[e], sh.cw[b0 + e] = w[e];
        t.c += c[e], t.w += w[e];
    }
    return t;
}

// Radix select over the keys in [lo, khi] of the row (khi = the row's largest key), descending:
// the key of the first non-empty p-group whose cumulative (count / mass / weight, in canonical
// order) reaches target (>= target; strict: > target). Sel.w_above / cnt_above: totals of the
// keys above it. The digits cover only the bits below the common prefix of lo and khi (split
// evenly into <= Cfg<CL>::DIGIT-bit digits, >= 5 bits each): flat rows then spread over the bins of the
// first pass instead of piling into a few exponent bins (same-address atomics serialize).
// Any split gives the same key (the digits only narrow the search), so this is a free choice.
//
// One pass: local histogram (atomics) -> cluster.sync -> combine the CL histograms over DSMEM
// into cc / cw (each warp a contiguous chunk of nb / 32 bins, and the chunk's totals) ->
// __syncthreads -> every warp finds the bin by itself (the same integer arithmetic, so the same
// answer; no broadcast barrier): lane l takes chunk 31 - l (bins descending), a warp scan of the
// chunk totals and a ballot pick the chunk, a second scan + ballot over its <= 64 bins the bin.
// The first chunk / bin whose cumulative reaches the target with a non-zero count is the first
// such bin overall: an empty bin has zero weight, so a chunk qualifies exactly when its last
// non-empty bin does. Histogram slots alternate (hs); the slot of the NEXT pass is zeroed right
// after this pass's cluster.sync (every CTA has then finished reading it, in the previous pass)
// and the __syncthreads after the combine orders the zeroing before that pass's atomics, so a
// pass needs one cluster.sync and one __syncthreads. Both slots are zeroed at kernel start.
template <int CL>
__device__ Sel radix_select(cg::cluster_group &cl, typename Cfg<CL>::Shared &sh, int &hs, const Row &r, int mode,
                            unsigned lo, unsigned khi, u64 target, bool strict) {
    Sel s{0u, 0u, 0u, 0ull, 1};
    const int lane = threadIdx.x & 31;
    const int hi = max(32 - __clz(lo ^ khi), 5);  // keys in [lo, khi] share the bits >= hi
    constexpr int DIGIT = Cfg<CL>::DIGIT, BINS = Cfg<CL>::BINS;
    const int npass = (hi + DIGIT - 1) / DIGIT;
    unsigned pref = khi >> hi;
    int pshift = hi;
    for (int pass = 0; pass < npass; pass++) {
        const int bits = hi / npass + (pass < hi % npass);
        const int shift = pshift - bits, nb = 1 << bits;  // 32 <= nb <= 2048
        unsigned *hc = sh.hcnt[hs], *hl = sh.hlo[hs], *hh = sh.hhi[hs];
        for (int i = threadIdx.x; i < r.cnt; i += THREADS) {
            const unsigned k = r.key[i];
            if (k < lo || (k >> pshift) != pref) continue;
            const unsigned bin = (k >> shift) & (nb - 1);
            atomicAdd(&hc[bin], 1u);
            if (mode != COUNT) {
                const u64 v = mode == MASS ? fix_p(k) : fix_w(r, i);
                const unsigned vl = (unsigned)v, vh = (unsigned)(v >> 32);
                const unsigned old = atomicAdd(&hl[bin], vl);
                const unsigned carry = (old + vl) < old;  // exact 64-bit sum: hi gets the carries
                if (vh + carry) atomicAdd(&hh[bin], vh + carry);
            }
        }
        cl.sync();
        hs ^= 1;
        for (int b = threadIdx.x; b < BINS; b += THREADS) sh.hcnt[hs][b] = sh.hlo[hs][b] = sh.hhi[hs][b] = 0;
        // combine: thread t holds bins [t * bpt, (t + 1) * bpt), so a chunk of nb / 32 bins is
        // tpc = nb / 32 / bpt consecutive lanes of one warp (whole warps idle when nb < 1024)
        const int bpt = nb > THREADS ? nb / THREADS : 1, b0 = threadIdx.x * bpt, per = nb / 32;
        if (b0 < nb) {
            CW t = bpt == 2 ? combine_bins<CL, 2>(cl, sh, hc, hl, hh, b0, mode)
                            : combine_bins<CL, 1>(cl, sh, hc, hl, hh, b0, mode);
            const int tpc = per / bpt;
            for (int o = tpc >> 1; o; o >>= 1) t.c += shfl_x(t.c, o), t.w += shfl_x(t.w, o);
            if ((lane & (tpc - 1)) == 0) sh.chc[b0 / per] = t.c, sh.chw[b0 / per] = t.w;
        }
        __syncthreads();
        // chunk: lane l scans chunk 31 - l
        const unsigned tc = sh.chc[31 - lane];
        const u64 tw = sh.chw[31 - lane];
        unsigned ic = tc;
        u64 iw = tw;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const unsigned c = __shfl_up_sync(0xffffffffu, ic, o);
            const u64 x = __shfl_up_sync(0xffffffffu, iw, o);
            if (lane >= o) ic += c, iw += x;
        }
        const u64 reach = s.w_above + iw;
        const unsigned ballot = __ballot_sync(0xffffffffu, tc > 0 && (strict ? reach > target : reach >= target));
        if (ballot == 0) { s.found = 0; return s; }
        const int L = __ffs(ballot) - 1, top = nb - 1 - L * per;  // the chunk's highest bin
        const u64 cw0 = __shfl_sync(0xffffffffu, s.w_above + iw - tw, L);
        const unsigned cc0 = __shfl_sync(0xffffffffu, s.cnt_above + ic - tc, L);
        // bin inside the chunk: lane l takes its descending positions [l * k, l * k + k)
        const int k = per > 32 ? per / 32 : 1;  // 2 when per = 64
        unsigned c0 = 0, c1 = 0;
        u64 w0 = 0, w1 = 0;
        if (k == 2) {  // bins top - 2l, top - 2l - 1 (a 16-byte pair: top - 2l - 1 is even)
            const uint2 cv = *reinterpret_cast<const uint2 *>(&sh.cc[top - 2 * lane - 1]);
            const ulonglong2 wv = *reinterpret_cast<const ulonglong2 *>(&sh.cw[top - 2 * lane - 1]);
            c0 = cv.y, c1 = cv.x, w0 = wv.y, w1 = wv.x;
        } else if (lane < per) {
            c0 = sh.cc[top - lane], w0 = sh.cw[top - lane];
        }
        unsigned jc = c0 + c1;
        u64 jw = w0 + w1;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const unsigned c = __shfl_up_sync(0xffffffffu, jc, o);
            const u64 x = __shfl_up_sync(0xffffffffu, jw, o);
            if (lane >= o) jc += c, jw += x;
        }
        const u64 run0 = cw0 + jw - (w0 + w1), run1 = run0 + w0;  // weight above position 0 / 1
        const unsigned cab0 = cc0 + jc - (c0 + c1);
        const bool q0 = c0 > 0 && (strict ? run1 > target : run1 >= target);
        const bool q1 = c1 > 0 && (strict ? run1 + w1 > target : run1 + w1 >= target);
        // a bin qualifies in this chunk (see above); __ffs(0) - 1 = -1 would only read lane 31
        const int L2 = __ffs(__ballot_sync(0xffffffffu, q0 || q1)) - 1;
        const bool first = __shfl_sync(0xffffffffu, q0, L2);
        const int pos = L2 * k + (first ? 0 : 1);
        s.w_above = __shfl_sync(0xffffffffu, first ? run0 : run1, L2);
        s.cnt_above = __shfl_sync(0xffffffffu, first ? cab0 : cab0 + c0, L2);
        s.cnt_at = __shfl_sync(0xffffffffu, first ? c0 : c1, L2);
        pref = (pref << bits) | (unsigned)(top - pos);
        pshift = shift;
    }
    s.key = pref;
    return s;
}

// Walk the row in id order: wgt = weight of keys > g; inside the group key == g, members of
// ordinal < lim are kept (a prefix in id order); wgrp = their weight; found = the first kept
// member whose cumulative group weight (from gbase) exceeds target (INT_MAX: none), last = the
// last kept member. find = false: only the sums (wgt, wgrp). FIRST: compute the weights of the keys >= g
// from z and store them in place of z (the first walk, g = kthr); otherwise they are cached.
template <int CL, bool FIRST>
__device__ Walk group_walk(cg::cluster_group &cl, typename Cfg<CL>::Shared &sh, int &xs, const Row &r, unsigned g,
                           long long lim, u64 target, bool find) {
    const int per = (r.cnt + THREADS - 1) / THREADS;
    const int i0 = min(r.cnt, (int)threadIdx.x * per), i1 = min(r.cnt, i0 + per);
    CW mine{0u, 0ull};
    u64 wgt = 0;
    // sums in any order: start the chunk at a per-thread rotation (a 2-way instead of a 16-way
    // bank conflict for 16-element chunks)
    const int rot = per ? (int)threadIdx.x % per : 0;
    for (int jj = 0; jj < per; jj++) {
        const int i = i0 + (jj + rot < per ? jj + rot : jj + rot - per);
        if (i >= i1) continue;
        const unsigned k = r.key[i];
        if (k < g) continue;
        u64 w;
        if (FIRST) {
            const float wf = weight_of(r, r.z[i]);
            r.z[i] = wf;  // this thread's own chunk: re-read below by this thread only
            w = fix_f(wf);
        } else {
            w = fix_w(r, i);
        }
        if (k > g) wgt += w;
        else mine.c++, mine.w += w;
    }
    if (!find && lim == 0x7fffffffffffffffll) {
        // sums only, every member kept (no top-k cut inside this group): no id order needed, so
        // no block scan and no cluster prefix exchange (found / last are not computed)
        Walk res = cl_reduce<CL>(cl, sh, xs, Walk{wgt, mine.w, 0x7fffffff, 0x7fffffff}, OpWalk());
        res.last = -1;
        return res;
    }
    CW tot;
    CW off = block_scan(sh, mine, &tot);
    // offsets of this CTA in the cluster: totals of the lower ranks
    CW *xt = reinterpret_cast<CW *>(sh.xraw[xs]);
    if (threadIdx.x == 0) *xt = tot;
    cl.sync();
    const int rank = (int)cl.block_rank();
    for (int j = 0; j < rank; j++) {
        const CW t = *cl.map_shared_rank(xt, j);
        off.c += t.c, off.w += t.w;
    }
    xs ^= 1;
    long long ord = off.c;
    u64 cum = off.w;
    // found: min id; last kept member = the largest kept id, reduced as min of -(id + 1)
    Walk wk{wgt, 0ull, 0x7fffffff, 0x7fffffff};
    for (int i = i0; i < i1 && mine.c; i++) {  // in id order, only threads holding members
        if (r.key[i] != g) continue;
        if (ord >= lim) break;
        const u64 w = fix_w(r, i);
        if (find && cum <= target && cum + w > target) wk.found = r.base + i;
        cum += w, wk.wgrp += w;
        ord++;
        wk.last = -(r.base + i) - 1;
    }
    Walk res = cl_reduce<CL>(cl, sh, xs, wk, OpWalk());
    res.last = res.last == 0x7fffffff ? -1 : -res.last - 1;
    return res;
}

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

template <int CL>
__global__ void __cluster_dims__(CL, 1, 1) __launch_bounds__(THREADS, 1) sampler_kernel(Args a) {
    using Shared = typename Cfg<CL>::Shared;
    constexpr int BINS = Cfg<CL>::BINS;
    extern __shared__ __align__(16) unsigned char smem[];
    Shared &sh = *reinterpret_cast<Shared *>(smem);
    float *zs = reinterpret_cast<float *>(smem + sizeof(Shared));
    unsigned *ks = reinterpret_cast<unsigned *>(zs + a.n_loc);
    cg::cluster_group cl = cg::this_cluster();
    const int rank = (int)cl.block_rank();
    const int base = rank * a.n_loc;
    const int cnt = max(0, min(a.n_loc, a.V - base));
    // rows blockIdx.y, + gridDim.y, ... (the loop and the next-row prefetch: see the top)
    for (long long row = blockIdx.y; row < a.B; row += gridDim.y) {
        int xs = 0, hs = 0;

        const float T = a.fparams[row * 5 + 0], top_p = a.fparams[row * 5 + 1];
        const float decay = a.fparams[row * 5 + 4];
        const long long top_k = a.iparams[row * 2 + 0], seed = a.iparams[row * 2 + 1];
        const bool commit = a.commit[row] != 0;
        const bool greedy = a.greedy_only || !(T > 0.f);

        // 1. z = logits - penalty into shared memory; decayed penalty written back (commit rows).
        //    Both histogram slots start zeroed (radix_select keeps them so; the barrier of the
        //    first reduction orders this before any atomics).
        if (!greedy)
            for (int b = threadIdx.x; b < BINS; b += THREADS)
#pragma unroll
                for (int j = 0; j < 2; j++) sh.hcnt[j][b] = sh.hlo[j][b] = sh.hhi[j][b] = 0;
        const long long lg0 = row * a.lg_s + base;
        float *pen = a.penalty + row * a.pen_s + base;
        MaxArg mx{-INFINITY, 0x7fffffff};
#pragma unroll 4
        for (int i = threadIdx.x; i < cnt; i += THREADS) {
            const float p = pen[i];
            const float z = load_logit(a.logits, a.lg_dt, lg0 + i) - p;  // exact widening, as logits.float()
            zs[i] = z;
            if (commit) pen[i] = p * decay;
            if (z > mx.v || (z == mx.v && base + i < mx.i)) mx = {z, base + i};
        }
        if (a.prefetch && row + gridDim.y < a.B && threadIdx.x < 32) {  // this CTA's slice of the next row
            const long long nr = row + gridDim.y, es = a.lg_dt ? 2 : 4;
            prefetch_l2(static_cast<const char *>(a.logits) + (nr * a.lg_s + base) * es, cnt * es, threadIdx.x);
            prefetch_l2(a.penalty + nr * a.pen_s + base, cnt * 4ll, threadIdx.x);
        }
        mx = cl_reduce<CL>(cl, sh, xs, mx, OpMaxArg());
        if (mx.i == 0x7fffffff) mx.i = 0;  // all NaN / -inf: token 0
        const float m = mx.v;
        int tok = mx.i;
        // dbg (rank 0, thread 0): each value is written where it is known (short live ranges: the
        // kernel runs at the 64-register limit); greedy rows keep the defaults
        float *const d = a.dbg && rank == 0 && threadIdx.x == 0 ? a.dbg + row * 8 : nullptr;
        if (d) d[0] = m, d[1] = 0.f, d[2] = 0.f, d[3] = (float)a.V, d[4] = 0.f, d[5] = 0.f, d[6] = 0.f, d[7] = 0.f;

        if (!greedy) {
            // 2. S (exact fixed-point sum of exp(z - m)), then the keys
            u64 es = 0;
            for (int i = threadIdx.x; i < cnt; i += THREADS) {
                const float e = expf(zs[i] - m);
                ks[i] = __float_as_uint(e);
                es += __float2ull_rz(e * FIX47);
            }
            es = cl_reduce<CL>(cl, sh, xs, es, OpSum());
            const float S = __ull2float_rn(es) * (1.0f / FIX47);
            if (d) d[1] = S;
            const unsigned kmax = __float_as_uint(__fdiv_rn(1.0f, S));
            // keys p = e / S, and z of the rank-0 token: the smallest id with the largest key
            // (usually the argmax; this thread's ids ascend, so its first hit is its smallest)
            MinTok t0{0x7fffffff, 0.f, 0xffffffffu};
            for (int i = threadIdx.x; i < cnt; i += THREADS) {
                const unsigned k = __float_as_uint(__fdiv_rn(__uint_as_float(ks[i]), S));
                ks[i] = k;
                if (k == kmax && base + i < t0.i) t0.i = base + i, t0.z = zs[i];
                t0.kmin = min(t0.kmin, k);
            }
            t0 = cl_reduce<CL>(cl, sh, xs, t0, OpMinTok());
            Row r{zs, ks, cnt, base, t0.i == 0x7fffffff ? m : t0.z, T};
            const unsigned kmin = min(t0.kmin, kmax);

            // 3. top-p cutoff c*
            unsigned cstar = 0;  // key 0: every token kept
            long long n_p = a.V;
            if (!(top_p >= 1.0f)) {  // NaN: like top_p = 0 (the reference's cum < NaN is false)
                const u64 tp = top_p > 0.f ? (u64)ceil((double)top_p * 70368744177664.0) : 0ull;
                const Sel s = radix_select<CL>(cl, sh, hs, r, MASS, kmin, kmax, tp, false);
                if (s.found) cstar = s.key, n_p = (long long)s.cnt_above + s.cnt_at;
            }
            if (d) d[2] = __uint_as_float(cstar), d[3] = (float)n_p;
            // 4. top-k
            unsigned kthr = cstar;
            long long lim = 0x7fffffffffffffffll;
            if (top_k > 0 && top_k < n_p) {
                const Sel s = radix_select<CL>(cl, sh, hs, r, COUNT, kmin, kmax, (u64)top_k, false);
                kthr = s.key;
                lim = top_k - (long long)s.cnt_above;
            }
            if (d) d[4] = __uint_as_float(kthr), d[5] = (float)(lim > (1ll << 40) ? -1 : lim);
            // 5. total kept weight, target, crossing
            const Walk tw = group_walk<CL, true>(cl, sh, xs, r, kthr, lim, 0ull, false);
            const u64 W = tw.wgt + tw.wgrp;
            const u64 zz = splitmix64(splitmix64((u64)seed) + (u64)a.pos[row]);
            const float u = (float)(zz >> 40) * (1.0f / 16777216.0f);
            const u64 t = (u64)floor((double)W * (double)u);
            if (d) d[6] = (float)((double)W / 70368744177664.0), d[7] = (float)((double)t / 70368744177664.0);
            if (t < tw.wgt) {  // the crossing is among the tokens with p > kthr (all kept)
                const Sel s = radix_select<CL>(cl, sh, hs, r, WEIGHT, kthr + 1, kmax, t, true);
                const Walk f = group_walk<CL, false>(cl, sh, xs, r, s.key, 0x7fffffffffffffffll, t - s.w_above, true);
                tok = f.found != 0x7fffffff ? f.found : (f.last >= 0 ? f.last : tok);
            } else {
                const Walk f = group_walk<CL, false>(cl, sh, xs, r, kthr, lim, t - tw.wgt, true);
                tok = f.found != 0x7fffffff ? f.found : (f.last >= 0 ? f.last : tok);
            }
        }

        // 6. penalty / seen of the chosen token (its owner CTA; the decay above is visible after
        //    the barrier), the output
        __syncthreads();
        if (threadIdx.x == 0 && commit && tok >= base && tok < base + cnt) {
            unsigned char *sn = a.seen + row * a.seen_s;
            const bool was = sn[tok] != 0;
            float *pp = a.penalty + row * a.pen_s + tok;
            *pp = *pp + (was ? a.fparams[row * 5 + 3] : a.fparams[row * 5 + 2]);  // repetition : presence
            sn[tok] = 1;
        }
        if (threadIdx.x == 0 && rank == 0) a.out[row] = tok;
        cl.sync();  // no CTA exits while another may still read its shared memory
    }
}

// The opt-in to > 48 KiB of shared memory for sampler_kernel<CL>, once per device (the first call
// is eager: the engine's warm-up runs before any CUDA-graph capture).
template <int CL>
cudaError_t prepare(int dev) {
    static bool done[64] = {};  // per device (one table per cluster size: a static of prepare<CL>)
    if (done[dev & 63]) return cudaSuccess;
    const int bytes = (int)(sizeof(typename Cfg<CL>::Shared) + (size_t)Cfg<CL>::MAX_LOCAL * 8);
    const cudaError_t e = cudaFuncSetAttribute(sampler_kernel<CL>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    done[dev & 63] = e == cudaSuccess;
    return e;
}

// Rows of CL-CTA clusters resident at once on this device (its GPCs decide: on the H200 30 for
// CL = 4, 39 for CL = 3), once per device; 0 if unknown.
template <int CL>
int rows_per_wave(int dev) {
    static int rows[64] = {};
    int &r = rows[dev & 63];
    if (r == 0 && prepare<CL>(dev) == cudaSuccess) {
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(CL, 1024);
        cfg.blockDim = dim3(THREADS);
        cfg.dynamicSmemBytes = sizeof(typename Cfg<CL>::Shared) + (size_t)Cfg<CL>::MAX_LOCAL * 8;
        cudaLaunchAttribute at;
        at.id = cudaLaunchAttributeClusterDimension;
        at.val.clusterDim.x = CL, at.val.clusterDim.y = 1, at.val.clusterDim.z = 1;
        cfg.attrs = &at, cfg.numAttrs = 1;
        if (cudaOccupancyMaxActiveClusters(&r, (void *)sampler_kernel<CL>, &cfg) != cudaSuccess) {
            cudaGetLastError();
            r = -1;
        }
    }
    return r > 0 ? r : 0;
}

// RWKV_SAMPLER_PERSIST=0: a cluster per row (the grid as large as the batch; no prefetch either);
// RWKV_SAMPLER_PREFETCH=0: one wave of clusters looping over the rows, without the L2 prefetch.
// Read once. The results do not depend on either.
inline bool env_on(const char *name) {
    const char *v = getenv(name);
    return !(v && v[0] == '0');
}
inline bool persistent() {
    static const bool on = env_on("RWKV_SAMPLER_PERSIST");
    return on;
}
inline bool prefetch_on() {
    static const bool on = env_on("RWKV_SAMPLER_PREFETCH");
    return on;
}

template <int CL>
int launch(const Args &a, int B, cudaStream_t st) {
    int dev = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e == cudaSuccess) e = prepare<CL>(dev);
    if (e != cudaSuccess) return (int)e;
    const size_t bytes = sizeof(typename Cfg<CL>::Shared) + (size_t)a.n_loc * 8;
    const int wave = persistent() ? rows_per_wave<CL>(dev) : 0;  // 0: unknown or off, a cluster per row
    const int G = wave > 0 && wave < B ? wave : B;
    Args b = a;
    b.B = B, b.prefetch = G < B && prefetch_on();
    sampler_kernel<CL><<<dim3(CL, G), THREADS, bytes, st>>>(b);
    return (int)cudaGetLastError();
}

// The cluster size for V <= 65536 when the caller leaves it open: 4 while the rows fit in one
// wave of 4-CTA clusters (shorter rows per CTA), else 3 (more rows per wave). Measured on the H200
// (kernel alone, ms per step, 4 -> 3): B=32 0.103 -> 0.060, B=64 0.155 -> 0.117, B=256 0.493 ->
// 0.448, B=1024 1.843 -> 1.682; B=1 0.054 -> 0.058.
inline int auto_cluster(int B) {
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) return 4;
    const int wave = rows_per_wave<4>(dev);
    return wave > 0 && B > wave ? 3 : 4;
}

}  // namespace sampler_k

// One sampler step for rows [0, B). logits (B, V) fp32 / fp16 / bf16 (lg_dt 0 / 1 / 2) rows lg_s apart; penalty (B, V) fp32
// rows pen_s apart (updated); seen (B, V) bool rows seen_s apart (updated); fparams (B, 5) fp32,
// iparams (B, 2) int64, positions (B,) int64, commit (B,) bool: contiguous; out (B,) int64;
// dbg: null or (B, 8) fp32 (m, S, c*, n kept by top-p, top-k threshold, its group limit,
// total weight, target). cl: the cluster size for V <= 65536, 4 or 3 (the large-batch shape, see
// Cfg); 0 = auto_cluster(B); larger V always 8. The results do not depend on it.
// Returns 0, a CUDA error, or -2 (V, dtype or cl not covered: use the torch path).
extern "C" int sampler_step(void *logits, long long lg_s, void *penalty, long long pen_s, void *seen,
                            long long seen_s, void *fparams, void *iparams, void *positions, void *commit,
                            int greedy_only, int B, int V, void *out, void *dbg, int lg_dt, int cl, void *stream) {
    using namespace sampler_k;
    if (B <= 0) return 0;
    if (V <= 0 || V > 8 * MAX_LOCAL) return UNSUPPORTED;
    if (lg_dt < 0 || lg_dt > 2 || (cl != 0 && cl != 3 && cl != 4)) return UNSUPPORTED;
    Args a{logits, lg_s, static_cast<float *>(penalty), pen_s,
           static_cast<unsigned char *>(seen), seen_s, static_cast<const float *>(fparams),
           static_cast<const long long *>(iparams), static_cast<const long long *>(positions),
           static_cast<const unsigned char *>(commit), static_cast<long long *>(out), static_cast<float *>(dbg),
           greedy_only, V, 0, lg_dt, B, 0};
    cudaStream_t st = static_cast<cudaStream_t>(stream);
    if (cl == 0 && V <= 4 * MAX_LOCAL) cl = auto_cluster(B);
    if (cl == 3 && V <= 3 * Cfg<3>::MAX_LOCAL) {
        a.n_loc = (V + 2) / 3;
        return launch<3>(a, B, st);
    }
    if (V <= 4 * MAX_LOCAL) {
        a.n_loc = (V + 3) / 4;
        return launch<4>(a, B, st);
    }
    a.n_loc = (V + 7) / 8;
    return launch<8>(a, B, st);
}
