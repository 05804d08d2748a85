// The row phase of the pipelined decode time-mix (wkv7_tmix_pipe.cu) on the tensor cores, for an
// fp16 state and head size 64. Same step as wkv7_common.cuh's step(), rearranged:
//     sa_i = sum_j S[i, j] a[j]                        (old state)
//     S'[i, j] = S[i, j] w[j] + sa_i b[j] + v_i k[j]
//     y_i  = sum_j S'[i, j] r[j] = sum_j S[i, j] (w r)[j] + sa_i (b . r) + v_i (k . r)
// so both sums are products of the OLD state (fp16, exactly as stored) with vectors: one
// mma.m16n8k16 per 16 columns (MMA 1), and the rank-2 update is a product of a 16 x 16 matrix
// with one 16 x 8 tile per 8 columns, accumulated onto C = S w (MMA 2). The vectors enter the
// MMAs as fp16 hi + lo pairs (x = hi + lo to ~2^-22), so the products carry ~fp32 precision: MMA 1's
// B columns are a_hi a_lo a_hi a_lo (wr)_hi (wr)_lo 0 0, MMA 2's k slots sa_hi.b_hi + sa_hi.b_lo +
// sa_lo.b_hi + v_hi.k_hi + v_hi.k_lo + v_lo.k_hi (the lo.lo terms are below fp32 rounding).
// Range: sa, v, k', b and w r must stay below 65504 (fp16), as the stored state already must.
//
// Thread layout (128 threads, warp w owns rows 16w .. 16w + 15): lane (g = lane / 4, t = lane % 4)
// holds rows 16w + g and 16w + g + 8, columns col(t, m) for m < 16 (8t .. 8t + 7 and 32 + 8t ..
// 32 + 8t + 7), as 8 words of two fp16 each: word i = columns col(t, 2i), col(t, 2i + 1). The k
// order inside an MMA is free (A and B use the same map) and so is the column order of its output
// tiles (B's columns pick them), so these words are at once MMA 1's A fragments (k-tile q: words
// 2q and 2q + 1 of both rows) and MMA 2's C fragments (n-tile p: word p of both rows), with no
// shuffles or reordering: a row's 16 columns load as two 16-byte shared-memory reads and store
// back as two 16-byte global writes (a warp's write covers whole 64-byte halves of 8 rows).
// Per head and thread: 4 + 8 MMAs, 32 multiplies, 16 conversions each way; the CUDA-core step()
// needs ~100 FMAs and 12 shuffles per row. Step 2 (mma_columns) gives each column to one thread
// and leaves the k normalization to the rows (MmaCols), so no warp works alone before the barrier.
#pragma once
#include "wkv7_tmix_head.cuh"

namespace wkv7 {

constexpr int MN = 64;  // the head size this layout is for

// The per-head vectors of the MMA row phase (shared memory, written by mma_columns).
// The k normalization is left to the rows: a' = -k k_k and b' = (k k_k) a_gate are the unnormalized
// a and b (a = a' / |k k_k|, b = b' / |k k_k|), so every column is done by one thread without a
// head-wide sum first; the rows scale S a' by 1 / |k k_k|^2 (see mma_rows).
struct alignas(16) MmaCols {
    __half t1[6][MN];       // MMA 1's B columns n = 0..5 (a'_hi a'_lo a'_hi a'_lo (wr)_hi (wr)_lo) at
                            // [n][16 t + m] (column col(t, m))
    uint32_t t2[3][8][8];   // MMA 2's B: [t][n][p] = k slots 2t, 2t + 1 of column n of n-tile p
    float dec[MN], v[MN], y[MN];
    float part[2][4];       // per warp 0 / 1: |k k_k|^2, bonus, k'.r, b'.r
    float red[1 + 2 * 4];   // bonus, then per-warp GroupNorm sum and M2 (head_gn_out)
};

// column c -> the (t, m) of col(t, m) == c
__device__ __forceinline__ void mma_tm(int c, int &t, int &m) {
    const int hi = c >= 32, cc = c - 32 * hi;
    t = cc >> 3, m = (cc & 7) + 8 * hi;
}

__device__ __forceinline__ __half hi16(float x) { return __float2half_rn(x); }
__device__ __forceinline__ __half lo16(float x) { return __float2half_rn(x - __half2float(__float2half_rn(x))); }
__device__ __forceinline__ uint32_t hpack(__half lo, __half hi) {
    return (uint32_t)__half_as_ushort(lo) | ((uint32_t)__half_as_ushort(hi) << 16);
}

// The per-head weights of mma_columns' roles: threads c < N the a0, k_k, k_a, r_k of column c;
// threads 64 + c the w0, v0 of column c and the lnx_w, lnx_b of output row c (head_gn_out).
struct MmaConsts {
    float a0 = 0.f, kkw = 0.f, ka = 0.f, rk = 0.f;
    float w0 = 0.f, v0 = 0.f, lw_o = 0.f, lb_o = 0.f;

    template <typename F>
    __device__ __forceinline__ void load(const TmixArgs &p, int hc, int tid) {
        auto ld = [&](const void *ptr, int i) { return to_f(((const F *)ptr)[i]); };
        auto lbias = [&](const void *bias, int i) { return bias ? ld(bias, i) : 0.f; };
        if (tid < MN) {
            const int c = hc + tid;
            a0 = lbias(p.a0, c), kkw = ld(p.k_k, c), ka = ld(p.k_a, c), rk = ld(p.r_k, c);
        } else if (tid - 64 < MN) {
            const int c = hc + tid - 64;
            w0 = lbias(p.w0, c), v0 = p.layer0 ? 0.f : lbias(p.v0, c), lw_o = ld(p.lnx_w, c), lb_o = ld(p.lnx_b, c);
        }
    }
};

// Step 2 for the MMA rows: one column per thread. Threads c < 64: k', a', b', r of column c into
// the tables, and warp 0 / 1 partial sums; threads 64 + c: the decay and w r of column c, v of
// row c; returns the gate of row c (threads 64..). Same arithmetic as head_columns.
template <typename F>
__device__ __forceinline__ float mma_columns(const HeadActs<F> &x, const MmaConsts &w, bool l0, int tid, MmaCols &m) {
    auto round_f = [&](float v) { return to_f(from_f<F>(v)); };  // torch's add in dtype F
    if (tid < MN) {
        const int c = tid;
        const float kr = to_f(x.k[c]), rr = to_f(x.r[c]), az = to_f(x.az[c]);
        const float ag = sigmoidf(round_f(az + w.a0));
        const float kkr = kr * w.kkw;
        const float kf = kr * (1.f + (ag - 1.f) * w.ka);
        const float bp = kkr * ag;  // b'
        int t, q;
        mma_tm(c, t, q);
        const __half ah = hi16(-kkr), al = lo16(-kkr), bh = hi16(bp), kh = hi16(kf);
        m.t1[0][16 * t + q] = ah, m.t1[1][16 * t + q] = al;
        m.t1[2][16 * t + q] = ah, m.t1[3][16 * t + q] = al;
        const int n = 2 * t + (q & 1), p = q >> 1;  // c is column n of MMA 2's n-tile p
        m.t2[0][n][p] = hpack(bh, lo16(bp));
        m.t2[1][n][p] = hpack(bh, kh);
        m.t2[2][n][p] = hpack(lo16(kf), kh);
        const float sq = warp_sum(kkr * kkr), bon = warp_sum(rr * kf * w.rk);
        const float kdot = warp_sum(kf * rr), bdot = warp_sum(bp * rr);
        if ((tid & 31) == 0) {
            float *pt = m.part[tid >> 5];
            pt[0] = sq, pt[1] = bon, pt[2] = kdot, pt[3] = bdot;
        }
        return 0.f;
    }
    if (tid - 64 >= MN) return 0.f;
    const int c = tid - 64;
    const float wz = to_f(x.wz[c]), rr = to_f(x.r[c]), g_o = to_f(x.g[c]), vr = to_f(x.v[c]);
    const float vf = l0 ? 0.f : to_f(x.v_first[c]), vz = l0 ? 0.f : to_f(x.vz[c]);
    const float dw = -softplusf(-round_f(wz + w.w0)) - 0.5f;
    const float dec = expf(-expf(dw));
    int t, q;
    mma_tm(c, t, q);
    m.dec[c] = dec;
    m.t1[4][16 * t + q] = hi16(dec * rr), m.t1[5][16 * t + q] = lo16(dec * rr);
    m.v[c] = l0 ? vr : vr + (vf - vr) * sigmoidf(round_f(vz + w.v0));
    return g_o;
}

// d += A (16 x 16) B (16 x 8), fp16 in, fp32 accumulate
__device__ __forceinline__ void mma16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
}

__device__ __forceinline__ void lds8(const void *p, uint32_t *w) {  // two 16-byte shared-memory reads
    const uint4 x = reinterpret_cast<const uint4 *>(p)[0], y = reinterpret_cast<const uint4 *>(p)[1];
    w[0] = x.x, w[1] = x.y, w[2] = x.z, w[3] = x.w, w[4] = y.x, w[5] = y.y, w[6] = y.z, w[7] = y.w;
}

// A row's 8 words (columns col(t, 0..15)) from a row of N fp16 values (shared memory).
__device__ __forceinline__ void load_row(const __half *row, int t, uint32_t *w) {
    const uint4 x = *reinterpret_cast<const uint4 *>(row + 8 * t);
    const uint4 y = *reinterpret_cast<const uint4 *>(row + 32 + 8 * t);
    w[0] = x.x, w[1] = x.y, w[2] = x.z, w[3] = x.w, w[4] = y.x, w[5] = y.y, w[6] = y.z, w[7] = y.w;
}

__device__ __forceinline__ void store_row(__half *row, int t, const uint32_t *w) {
    st_global_v4(row + 8 * t, make_uint4(w[0], w[1], w[2], w[3]));
    st_global_v4(row + 32 + 8 * t, make_uint4(w[4], w[5], w[6], w[7]));
}

// Step 3 + 4a for one head: old state from `sst` (shared memory), new state to `shead` (global),
// y into m.y and the per-warp GroupNorm partials into m.red (as head_gn_sums with 16 rows per warp).
__device__ __forceinline__ void mma_rows(const __half *sst, __half *shead, MmaCols &m, int tid) {
    const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int r0 = 16 * warp + g, r1 = r0 + 8;
    uint32_t s0[8], s1[8];  // rows r0, r1: words i = columns col(t, 2i), col(t, 2i + 1)
    load_row(sst + r0 * MN, t, s0);
    load_row(sst + r1 * MN, t, s1);

    // MMA 1: (S a)_i and (S (w r))_i; lane t holds output columns 2t, 2t + 1: t < 2 sa, t = 2 S (w r)
    uint32_t b1[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    if (g < 6) lds8(&m.t1[g][16 * t], b1);
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int q = 0; q < 4; q++) mma16816(acc, s0[2 * q], s1[2 * q], s0[2 * q + 1], s1[2 * q + 1], b1[2 * q], b1[2 * q + 1]);
    const float x0 = acc[0] + acc[1], x1 = acc[2] + acc[3];
    // the k normalization (mma_columns): sa = S a = (S a') / |k k_k|, and sa b = (S a') b' / |k k_k|^2
    const float4 pa = *reinterpret_cast<const float4 *>(m.part[0]), pb = *reinterpret_cast<const float4 *>(m.part[1]);
    const float den = fmaxf(sqrtf(pa.x + pb.x), 1e-12f), inv2 = 1.f / (den * den);
    const float kdot = pa.z + pb.z, bdot = pa.w + pb.w;  // k' . r, b' . r
    if (tid == 0) m.red[0] = pa.y + pb.y;                 // the bonus, for head_gn_out
    const float sa0 = __shfl_sync(0xffffffffu, x0, lane & ~3) * inv2, sa1 = __shfl_sync(0xffffffffu, x1, lane & ~3) * inv2;
    const float v0 = m.v[r0], v1 = m.v[r1];

    // MMA 2's A (rows r0, r1; k slots s_hi s_hi s_lo v_hi v_hi v_lo 0 ..., s = (S a') / |k k_k|^2): lane
    // t holds slots 2t, 2t + 1
    uint32_t a0 = 0, a1 = 0;
    if (t == 0) a0 = hpack(hi16(sa0), hi16(sa0)), a1 = hpack(hi16(sa1), hi16(sa1));
    if (t == 1) a0 = hpack(lo16(sa0), hi16(v0)), a1 = hpack(lo16(sa1), hi16(v1));
    if (t == 2) a0 = hpack(hi16(v0), lo16(v0)), a1 = hpack(hi16(v1), lo16(v1));
    uint32_t b2[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    if (t < 3) lds8(&m.t2[t][g][0], b2);
    float wv[16];  // the decay of columns col(t, 0..15)
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const float4 d = *reinterpret_cast<const float4 *>(&m.dec[(i < 2 ? 8 * t : 24 + 8 * t) + 4 * i]);
        wv[4 * i] = d.x, wv[4 * i + 1] = d.y, wv[4 * i + 2] = d.z, wv[4 * i + 3] = d.w;
    }
    // MMA 2 per n-tile p (columns col(t, 2p), col(t, 2p + 1) of rows r0, r1): S' = S w + A B
#pragma unroll
    for (int p = 0; p < 8; p++) {
        const float2 f0 = __half22float2(*reinterpret_cast<const __half2 *>(&s0[p]));
        const float2 f1 = __half22float2(*reinterpret_cast<const __half2 *>(&s1[p]));
        float d[4] = {f0.x * wv[2 * p], f0.y * wv[2 * p + 1], f1.x * wv[2 * p], f1.y * wv[2 * p + 1]};
        mma16816(d, a0, a1, 0u, 0u, b2[p], 0u);
        s0[p] = pack2<__half>(d[0], d[1]), s1[p] = pack2<__half>(d[2], d[3]);
    }
    store_row(shead + r0 * MN, t, s0);
    store_row(shead + r1 * MN, t, s1);

    // y of rows r0, r1 (lanes t = 2), then the warp's GroupNorm partials over its 16 rows
    const float y0 = x0 + sa0 * bdot + v0 * kdot, y1 = x1 + sa1 * bdot + v1 * kdot;
    const bool mine = t == 2;
    const float ls = warp_sum(mine ? y0 + y1 : 0.f), wmean = ls / 16;
    const float m2 = warp_sum(mine ? (y0 - wmean) * (y0 - wmean) + (y1 - wmean) * (y1 - wmean) : 0.f);
    if (mine) m.y[r0] = y0, m.y[r1] = y1;
    if (lane == 0) m.red[1 + 2 * warp] = ls, m.red[2 + 2 * warp] = m2;
}

}  // namespace wkv7
