// Fused sampler (kernels/sampler.cu): the radix select -- its result (Sel) and modes (COUNT / MASS),
// the cluster combine of the per-CTA histograms over DSMEM (combine_bins), and radix_select, which
// finds the p-group where a count / mass target is reached (the top-k and top-p cuts).
#pragma once
#include "sampler_common.cuh"

namespace sampler_k {

struct Sel {
    unsigned key, cnt_above, cnt_at;
    u64 w_above;
    int found;
};

enum { COUNT = 0, MASS = 1 };

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
// the key of the first non-empty p-group whose cumulative (count / mass, in canonical order)
// reaches target (>= target). Sel.w_above / cnt_above: totals of the
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
                            unsigned lo, unsigned khi, u64 target) {
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
                const u64 v = fix_p(k);
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
        const unsigned ballot = __ballot_sync(0xffffffffu, tc > 0 && reach >= target);
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
        const bool q0 = c0 > 0 && run1 >= target;
        const bool q1 = c1 > 0 && run1 + w1 >= target;
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

}  // namespace sampler_k
