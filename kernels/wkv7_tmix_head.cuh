// The per-head phases of the one-launch decode time-mix, shared by tmix_head_kernel
// (wkv7_tmix_fused.cu: a head per block) and tmix_pipe_kernel (wkv7_tmix_pipe.cu: persistent
// blocks). A head's N rows run on head_threads<RPT>() threads: TPR lanes per row, RPT rows per
// thread, row group rg = tid / TPR owning rows rg + j * RG. Step 2 splits by warp: warp 0 the
// k / a / b / r columns and the bonus, warp 1 the v rows, threads 64 .. 64 + N - 1 the decay of
// column c = tid - 64 and, in step 4b, output row c.
#pragma once
#include "wkv7_tmix.cuh"

namespace wkv7 {

template <int RPT>
__host__ __device__ constexpr int head_threads() { return N * TPR / RPT; }

// The warp roles of step 2 need 2 warps + N threads; N > 64 (EPT = 16 columns per lane, RPT rows)
// would spill: those head sizes run the pure-torch twin (server.model.cuda_ops.tmix_decode).
template <int RPT>
__host__ __device__ constexpr bool head_ok() {
    return N <= 64 && head_threads<RPT>() >= 64 + N && head_threads<RPT>() % 32 == 0;
}

constexpr int CPL = N / 32;  // columns per lane in warps 0 and 1

// The head's N values of each activation (global memory, or a shared-memory copy).
template <typename F>
struct HeadActs {
    const F *r, *k, *v, *wz, *az, *g, *vz, *v_first;  // vz, v_first: unread in layer 0
};

// Where step 2 puts the head's per-column vectors (shared memory).
struct HeadCols {
    float *dec, *k, *a, *b, *r, *v;
};

// The per-head constant vectors of each role: warp 0 a0, k_k, k_a, r_k of columns wl + 32 q; warp 1
// v0 (in a0); threads 64.. w0, lnx_w, lnx_b of row c. Absent biases read as 0 (x + 0 rounded to F
// is x). Weights are never written, so they may be loaded before the PDL wait.
struct HeadConsts {
    float a0[CPL], kkw[CPL], ka[CPL], rk[CPL];
    float w0 = 0.f, lw_o = 0.f, lb_o = 0.f;

    template <typename F>
    __device__ __forceinline__ void load(const TmixArgs &p, int hc, int tid) {
        auto ld = [&](const void *ptr, long long i) { return to_f(((const F *)ptr)[i]); };
        auto lbias = [&](const void *bias, int c) { return bias ? ld(bias, c) : 0.f; };
        const int warp = tid / 32, wl = tid % 32;
        if (warp == 0) {
#pragma unroll
            for (int q = 0; q < CPL; q++) {
                const int c = hc + wl + 32 * q;
                a0[q] = lbias(p.a0, c), kkw[q] = ld(p.k_k, c), ka[q] = ld(p.k_a, c), rk[q] = ld(p.r_k, c);
            }
        } else if (warp == 1) {
#pragma unroll
            for (int q = 0; q < CPL; q++) a0[q] = p.layer0 ? 0.f : lbias(p.v0, hc + wl + 32 * q);
        } else if (tid - 64 < N) {
            const int c = hc + tid - 64;
            w0 = lbias(p.w0, c), lw_o = ld(p.lnx_w, c), lb_o = ld(p.lnx_b, c);
        }
    }
};

// Step 2: the head's per-column vectors into `cols` (decay, k', a = -kk, b = kk * a_gate, r, v) and
// the bonus sum(r k' r_k) into *bonus; returns the gate of row c (threads 64..). Each role loads
// all its inputs before any arithmetic and without branches: one memory round trip.
template <typename F>
__device__ __forceinline__ float head_columns(const HeadActs<F> &x, const HeadConsts &w, bool l0, int tid,
                                              const HeadCols &cols, float *bonus) {
    const int warp = tid / 32, wl = tid % 32;
    auto round_f = [&](float v) { return to_f(from_f<F>(v)); };  // torch's add in dtype F
    float g_o = 0.f;
    if (warp == 0) {
        float kr[CPL], rr[CPL], az[CPL];
#pragma unroll
        for (int q = 0; q < CPL; q++) {
            const int c = wl + 32 * q;
            kr[q] = to_f(x.k[c]), rr[q] = to_f(x.r[c]), az[q] = to_f(x.az[c]);
        }
        float kkr[CPL], ag[CPL], sq = 0.f, bon = 0.f;
#pragma unroll
        for (int q = 0; q < CPL; q++) {
            const int c = wl + 32 * q;
            ag[q] = sigmoidf(round_f(az[q] + w.a0[q]));
            kkr[q] = kr[q] * w.kkw[q];
            const float kf = kr[q] * (1.f + (ag[q] - 1.f) * w.ka[q]);
            cols.k[c] = kf;
            cols.r[c] = rr[q];
            sq += kkr[q] * kkr[q];
            bon += rr[q] * kf * w.rk[q];
        }
        sq = warp_sum(sq);
        bon = warp_sum(bon);
        const float den = fmaxf(sqrtf(sq), 1e-12f);
#pragma unroll
        for (int q = 0; q < CPL; q++) {
            const int c = wl + 32 * q;
            const float kk = kkr[q] / den;
            cols.a[c] = -kk;
            cols.b[c] = kk * ag[q];
        }
        if (wl == 0) *bonus = bon;
    } else if (warp == 1) {
        float vr[CPL], vf[CPL], vz[CPL];
#pragma unroll
        for (int q = 0; q < CPL; q++) {
            const int c = wl + 32 * q;
            vr[q] = to_f(x.v[c]);
            vf[q] = l0 ? 0.f : to_f(x.v_first[c]);
            vz[q] = l0 ? 0.f : to_f(x.vz[c]);
        }
#pragma unroll
        for (int q = 0; q < CPL; q++)  // a0 holds v0 in warp 1
            cols.v[wl + 32 * q] = l0 ? vr[q] : vr[q] + (vf[q] - vr[q]) * sigmoidf(round_f(vz[q] + w.a0[q]));
    } else if (tid - 64 < N) {
        const int c = tid - 64;
        const float wz = to_f(x.wz[c]);
        g_o = to_f(x.g[c]);
        const float dw = -softplusf(-round_f(wz + w.w0)) - 0.5f;
        cols.dec[c] = expf(-expf(dw));
    }
    return g_o;
}

// Step 4a: each warp's GroupNorm partials over its rows (sum, and M2 about the warp's own mean)
// into red[1 + 2 warp], red[2 + 2 warp]; the rows' y into sh_y.
template <int RPT>
__device__ __forceinline__ void head_gn_sums(const float (&y)[RPT], float *sh_y, float *red, int tid) {
    constexpr int RG = head_threads<RPT>() / TPR;
    constexpr int WROWS = 32 / TPR * RPT;  // rows per warp
    const int warp = tid / 32, wl = tid % 32, rg = tid / TPR, lane = tid % TPR;
    float ls = 0.f;
#pragma unroll
    for (int j = 0; j < RPT; j++) ls += y[j];
#pragma unroll
    for (int o = TPR; o < 32; o <<= 1) ls += __shfl_xor_sync(0xffffffffu, ls, o);  // across row groups
    const float wmean = ls / WROWS;
    float m2 = 0.f;
#pragma unroll
    for (int j = 0; j < RPT; j++) m2 += (y[j] - wmean) * (y[j] - wmean);
#pragma unroll
    for (int o = TPR; o < 32; o <<= 1) m2 += __shfl_xor_sync(0xffffffffu, m2, o);
    if (lane == 0) {
#pragma unroll
        for (int j = 0; j < RPT; j++) sh_y[rg + j * RG] = y[j];
    }
    if (wl == 0) red[1 + 2 * warp] = ls, red[2 + 2 * warp] = m2;
}

// Step 4b (threads 64.., after a barrier): the warps' partials combined (Chan), output row c
// normalized, plus the bonus times v, times the gate, into out[c].
// W: HeadConsts or the MMA path's MmaConsts (lw_o, lb_o of row c).
template <typename F, int RPT, typename W>
__device__ __forceinline__ void head_gn_out(const float *red, const float *sh_y, const float *sh_v,
                                            const W &w, float gn_eps, float g_o, F *out, int tid) {
    constexpr int NW = head_threads<RPT>() / 32;
    constexpr int WROWS = 32 / TPR * RPT;
    if (tid / 32 >= 2 && tid - 64 < N) {
        const int c = tid - 64;
        float tot = 0.f;
#pragma unroll
        for (int i = 0; i < NW; i++) tot += red[1 + 2 * i];
        const float mean = tot / N;
        float M2 = 0.f;
#pragma unroll
        for (int i = 0; i < NW; i++) {
            const float d = red[1 + 2 * i] / WROWS - mean;
            M2 += red[2 + 2 * i] + WROWS * d * d;
        }
        const float gn = (sh_y[c] - mean) * rsqrtf(M2 / N + gn_eps) * w.lw_o + w.lb_o;
        out[c] = from_f<F>((gn + red[0] * sh_v[c]) * g_o);
    }
}

}  // namespace wkv7
