// Fused sampler (kernels/sampler.cu): the id-order walk inside one p-group -- the exclusive block
// scan of (count, weight) (block_scan) and group_walk: the kept weights, the member where the
// cumulative weight crosses a target and the last kept member, with the cluster prefix exchange.
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
    // no trailing barrier: the caller (group_walk) reaches a cluster.sync before anything
    // rewrites s / rraw
    return {off.c + inc.c - v.c, off.w + inc.w - v.w};
}

// Walk the row in id order: wgt = weight of keys > g (sums only: 0 when find); inside the group
// key == g, members of ordinal < lim are kept (a prefix in id order); wgrp = their weight; found =
// the first kept member whose cumulative group weight (from gbase) exceeds target (INT_MAX: none),
// last = the last kept member. find = false: only the sums (wgt, wgrp). FIRST: compute the weights of the keys >= g
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
        if (k < g || (find && k > g)) continue;  // a find walk needs only the group's members
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

}  // namespace sampler_k
