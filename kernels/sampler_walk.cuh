// Fused sampler (kernels/sampler.cu): the inverse CDF in id order -- the exclusive block scan of
// (count, weight) (block_scan) and sample_walk: the kept weights (stored over z), their prefix
// sums over the cluster in id order, and the token where the cumulative weight crosses the target.
#pragma once
#include "sampler_common.cuh"

namespace sampler_k {

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
    // no trailing barrier: every caller reaches a cluster.sync (cl_prefix) before anything
    // rewrites s / rraw
    return {off.c + inc.c - v.c, off.w + inc.w - v.w};
}

// This thread's exclusive offset in id order over the whole cluster (a block scan, then the totals
// of the lower-ranked CTAs through the exchange slot) and, in *all, the cluster's total.
template <int CL>
__device__ CW cl_prefix(cg::cluster_group &cl, typename Cfg<CL>::Shared &sh, int &xs, CW v, CW *all) {
    CW tot;
    CW off = block_scan(sh, v, &tot);
    CW *xt = reinterpret_cast<CW *>(sh.xraw[xs]);
    if (threadIdx.x == 0) *xt = tot;
    cl.sync();
    const int rank = (int)cl.block_rank();
    CW sum{0u, 0ull};
#pragma unroll
    for (int j = 0; j < CL; j++) {
        const CW t = *cl.map_shared_rank(xt, j);
        if (j < rank) off.c += t.c, off.w += t.w;
        sum.c += t.c, sum.w += t.w;
    }
    xs ^= 1;
    *all = sum;
    return off;
}

struct Pick { u64 W, t; int found; };

// The inverse CDF over the kept tokens in id order: kept = key > g, or key == g and an ordinal
// (id order) inside that group < lim (the top-k cut; no cut: lim = LLONG_MAX). Each thread owns a
// contiguous chunk of ids: it computes the weights of its keys >= g once (stored in place of z)
// and sums its kept ones; one cluster prefix scan gives every thread its chunk's offset and the
// total W; t = floor(W * u); the one thread whose chunk holds the crossing (offset <= t <
// offset + its sum) walks it in id order to the first token whose cumulative weight exceeds t.
// W == 0 (unreachable: the rank-0 token weighs 1) leaves found = INT_MAX. Every sum is an integer
// sum, so W, t and the token do not depend on the cluster split or the thread count.
// Barriers: one cluster prefix (two with a top-k cut inside the group: its ordinals).
template <int CL>
__device__ Pick sample_walk(cg::cluster_group &cl, typename Cfg<CL>::Shared &sh, int &xs, const Row &r, unsigned g,
                            long long lim, float u) {
    const int per = (r.cnt + THREADS - 1) / THREADS;
    const int i0 = min(r.cnt, (int)threadIdx.x * per), i1 = min(r.cnt, i0 + per);
    u64 above = 0, grp = 0;  // this chunk's weight of keys > g, of the group key == g
    unsigned gc = 0;         // and the group's members
    // sums in any order: start the chunk at a per-thread rotation (a 2-way instead of a 16-way
    // bank conflict for 16-element chunks)
    const int rot = per ? (int)threadIdx.x % per : 0;
    for (int jj = 0; jj < per; jj++) {
        const int i = i0 + (jj + rot < per ? jj + rot : jj + rot - per);
        if (i >= i1) continue;
        const unsigned k = r.key[i];
        if (k < g) continue;
        const float wf = weight_of(r, r.z[i]);
        r.z[i] = wf;  // this thread's own chunk: re-read below by this thread only
        if (k > g) above += fix_f(wf);
        else gc++, grp += fix_f(wf);
    }
    CW all;
    long long ord = 0;  // ordinal (in the group) of this chunk's first member
    if (lim != 0x7fffffffffffffffll) {  // the top-k cut: keep the group's first lim members
        ord = cl_prefix<CL>(cl, sh, xs, CW{gc, 0ull}, &all).c;
        grp = 0;
        long long o = ord;
        for (int i = i0; i < i1 && o < lim; i++)
            if (r.key[i] == g) grp += fix_w(r, i), o++;
    }
    const u64 mine = above + grp;
    const u64 off = cl_prefix<CL>(cl, sh, xs, CW{0u, mine}, &all).w;
    Pick pk{all.w, (u64)floor((double)all.w * (double)u), 0x7fffffff};
    if (off <= pk.t && pk.t < off + mine) {  // the crossing is in this chunk (so mine > 0)
        u64 cum = off;
        for (int i = i0; i < i1; i++) {
            const unsigned k = r.key[i];
            if (k < g || (k == g && ord++ >= lim)) continue;
            cum += fix_w(r, i);
            if (cum > pk.t) {
                pk.found = r.base + i;
                break;
            }
        }
    }
    return pk;
}

}  // namespace sampler_k
