// Fused elementwise kernels of the prefill's time-mix (everything between its GEMMs and the WKV
// chunk kernel that is not a LayerNorm: those go through fused_add_ln_mix). Pure-torch twins:
// server.model.ops.{token_mix, tmix_prep, tmix_post}. As in fused_elementwise.cu, every
// intermediate that the torch sequence stores is rounded to F here too (rnd), so the results
// match the twins to ~1 ulp. Rows are the flattened (B, T) tokens, each of C = H * N channels.
//
// token_mix: out[k, b, t] = x[b, t] + round(prev - x[b, t]) * mix[k]   (k < K, fp32 then rounded)
//            prev = x[b, t - 1], or shift[b] at t = 0 (the state's token-shift row)
// tmix_prep, per token and head (a warp; lane l holds columns l * EPL ...):
//     w  = round(round(logsigmoid(round(w0 + wz))) - 0.5)       (written over wz)
//     ag = round(sigmoid(round(a0 + az)))
//     kr = round(k * k_k);  kk = round(kr / round(|kr|))        (the head's L2 norm)
//     k' = round(k * round(k_a1 + ag * k_a))                    (written over k)
//     v' = round(lerp(v, v_first, round(sigmoid(round(v0 + vz)))))  (over v; not in layer 0)
//     a  = -kk (over az);  b = round(kk * ag)
// tmix_post, per token and head:
//     gn = round(group_norm(y) * lnx_w + lnx_b)                 (the head's mean / biased variance)
//     s  = round(sum(round(round(r * k') * r_k)));  out = round(round(gn + round(s * v')) * g)
#include <type_traits>

#include "pdl.cuh"
#include "wkv7_common.cuh"
#include "wkv7_tmix.cuh"

namespace wkv7 {

namespace prefill {

constexpr int EPL = N / 32;      // channels per lane of a head's warp
constexpr int WARPS = 8;         // (token, head) pairs per block
constexpr int MIX_THREADS = 256;

// A lane's EPL consecutive channels of one head of one row, as fp32: one vector access where
// EPL values make 4, 8 or 16 bytes (the launchers ask for 16-byte aligned rows).
template <typename F>
struct LaneVec {
    static constexpr int BYTES = EPL * (int)sizeof(F);
    using V = std::conditional_t<BYTES == 4, uint32_t, std::conditional_t<BYTES == 8, uint2, uint4>>;
    static constexpr bool ONE = BYTES == 4 || BYTES == 8 || BYTES == 16;
};

template <typename F>
__device__ __forceinline__ void lane_load(const F *p, float (&o)[EPL]) {
    if constexpr (LaneVec<F>::ONE) {
        const typename LaneVec<F>::V raw = *reinterpret_cast<const typename LaneVec<F>::V *>(p);
        const F *f = reinterpret_cast<const F *>(&raw);
#pragma unroll
        for (int e = 0; e < EPL; e++) o[e] = to_f(f[e]);
    } else {
#pragma unroll
        for (int e = 0; e < EPL; e++) o[e] = to_f(p[e]);
    }
}

template <typename F>
__device__ __forceinline__ void lane_store(F *p, const float (&v)[EPL]) {
    if constexpr (LaneVec<F>::ONE) {
        typename LaneVec<F>::V raw;
        F *f = reinterpret_cast<F *>(&raw);
#pragma unroll
        for (int e = 0; e < EPL; e++) f[e] = from_f<F>(v[e]);
        *reinterpret_cast<typename LaneVec<F>::V *>(p) = raw;
    } else {
#pragma unroll
        for (int e = 0; e < EPL; e++) p[e] = from_f<F>(v[e]);
    }
}

template <typename F>
__global__ void token_mix_kernel(const F *__restrict__ x, const F *__restrict__ shift, long long shift_bs,
                                 const F *__restrict__ mix, F *__restrict__ out, int T, int C, int K,
                                 long long n4) {
    rwkv_pdl::pdl_wait();
    rwkv_pdl::pdl_trigger();
    const long long plane = n4 * 4;  // elements of one output plane (B * T * C)
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n4; i += stride) {
        const long long e0 = 4 * i, row = e0 / C;
        const int c = (int)(e0 - row * C), t = (int)(row % T);
        float xv[4], pv[4], d[4];
        load4<F>(x + e0, xv);
        if (t > 0) load4<F>(x + e0 - C, pv);
        else load4<F>(shift + (row / T) * shift_bs + c, pv);
#pragma unroll
        for (int j = 0; j < 4; j++) d[j] = rnd<F>(pv[j] - xv[j]);
        for (int k = 0; k < K; k++) {
            float m[4], o[4];
            load4<F>(mix + (long long)k * C + c, m);
#pragma unroll
            for (int j = 0; j < 4; j++) o[j] = xv[j] + d[j] * m[j];
            store4<F>(out + k * plane + e0, o);
        }
    }
}

struct PrepArgs {
    const void *v_first, *vz, *w0, *a0, *v0, *k_k, *k_a, *k_a1;
    void *k, *v, *wz, *az, *b;
    long long rows;
    int H;
};

template <typename F>
__global__ void __launch_bounds__(WARPS * 32) tmix_prep_kernel(PrepArgs p) {
    const int lane = threadIdx.x % 32;
    const long long item = (long long)blockIdx.x * WARPS + threadIdx.x / 32;  // (row, head)
    const int C = p.H * N;
    const int c0 = (int)(item % p.H) * N + lane * EPL;
    // the constants first: weights are never written by a kernel in flight (pdl.cuh)
    float w0[EPL], a0[EPL], kkw[EPL], ka[EPL], ka1[EPL], v0[EPL];
    lane_load((const F *)p.w0 + c0, w0), lane_load((const F *)p.a0 + c0, a0);
    lane_load((const F *)p.k_k + c0, kkw), lane_load((const F *)p.k_a + c0, ka);
    lane_load((const F *)p.k_a1 + c0, ka1);
    if (p.vz) lane_load((const F *)p.v0 + c0, v0);
    rwkv_pdl::pdl_wait();
    rwkv_pdl::pdl_trigger();
    if (item >= p.rows * p.H) return;  // whole warps: the head's norm below needs every lane
    const long long at = (item / p.H) * C + c0;
    F *k = (F *)p.k + at, *v = (F *)p.v + at, *wz = (F *)p.wz + at, *az = (F *)p.az + at;
    float kv[EPL], wv[EPL], av[EPL], vv[EPL], vf[EPL], vzv[EPL];
    lane_load(k, kv), lane_load(wz, wv), lane_load(az, av);
    if (p.vz) lane_load(v, vv), lane_load((const F *)p.v_first + at, vf), lane_load((const F *)p.vz + at, vzv);
    float kr[EPL], ag[EPL], sq = 0.f;
#pragma unroll
    for (int e = 0; e < EPL; e++) {
        wv[e] = rnd<F>(rnd<F>(-softplusf(-rnd<F>(w0[e] + wv[e]))) - 0.5f);
        ag[e] = rnd<F>(sigmoidf(rnd<F>(a0[e] + av[e])));
        kr[e] = rnd<F>(kv[e] * kkw[e]);
        sq += kr[e] * kr[e];
        kv[e] = rnd<F>(kv[e] * rnd<F>(ka1[e] + ag[e] * ka[e]));
    }
    const float den = fmaxf(rnd<F>(sqrtf(warp_sum(sq))), 1e-12f);
    float bv[EPL];
#pragma unroll
    for (int e = 0; e < EPL; e++) {
        const float kk = rnd<F>(kr[e] / den);
        av[e] = -kk;
        bv[e] = rnd<F>(kk * ag[e]);
    }
    if (p.vz) {
#pragma unroll
        for (int e = 0; e < EPL; e++) {  // torch.lerp's two forms, by the weight
            const float g = rnd<F>(sigmoidf(rnd<F>(v0[e] + vzv[e]))), d = vf[e] - vv[e];
            vv[e] = rnd<F>(g < 0.5f ? vv[e] + g * d : vf[e] - d * (1.f - g));
        }
        lane_store(v, vv);
    }
    lane_store(wz, wv), lane_store(k, kv), lane_store(az, av), lane_store((F *)p.b + at, bv);
}

struct PostArgs {
    const void *y, *r, *k, *v, *g, *r_k, *lnx_w, *lnx_b;
    void *out;
    long long rows;
    int H;
    float eps;
};

template <typename F>
__global__ void __launch_bounds__(WARPS * 32) tmix_post_kernel(PostArgs p) {
    const int lane = threadIdx.x % 32;
    const long long item = (long long)blockIdx.x * WARPS + threadIdx.x / 32;
    const int C = p.H * N;
    const int c0 = (int)(item % p.H) * N + lane * EPL;
    float rk[EPL], lw[EPL], lb[EPL];
    lane_load((const F *)p.r_k + c0, rk), lane_load((const F *)p.lnx_w + c0, lw), lane_load((const F *)p.lnx_b + c0, lb);
    rwkv_pdl::pdl_wait();
    rwkv_pdl::pdl_trigger();
    if (item >= p.rows * p.H) return;
    const long long at = (item / p.H) * C + c0;
    float y[EPL], r[EPL], k[EPL], v[EPL], g[EPL];
    lane_load((const F *)p.y + at, y), lane_load((const F *)p.r + at, r), lane_load((const F *)p.k + at, k);
    lane_load((const F *)p.v + at, v), lane_load((const F *)p.g + at, g);
    float sum = 0.f, bonus = 0.f;
#pragma unroll
    for (int e = 0; e < EPL; e++) {
        sum += y[e];
        bonus += rnd<F>(rnd<F>(r[e] * k[e]) * rk[e]);
    }
    const float mean = warp_sum(sum) / N;
    float m2 = 0.f;
#pragma unroll
    for (int e = 0; e < EPL; e++) m2 += (y[e] - mean) * (y[e] - mean);
    const float rstd = rsqrtf(warp_sum(m2) / N + p.eps);
    const float s = rnd<F>(warp_sum(bonus));
    float o[EPL];
#pragma unroll
    for (int e = 0; e < EPL; e++) {
        const float gn = rnd<F>((y[e] - mean) * rstd * lw[e] + lb[e]);
        o[e] = rnd<F>(rnd<F>(gn + rnd<F>(s * v[e])) * g[e]);
    }
    lane_store((F *)p.out + at, o);
}

inline int blocks_for(long long items) { return (int)((items + WARPS - 1) / WARPS); }

}  // namespace prefill
}  // namespace wkv7

// x: (B, T, C) contiguous; shift: B rows of C, shift_bs elements apart; mix: (K, C) contiguous;
// out: (K, B, T, C) contiguous; all in f_dt, 8-byte (16-bit) / 16-byte (fp32) aligned; C % 4 == 0.
extern "C" int prefill_token_mix(int f_dt, int B, int T, int C, const void *x, const void *shift,
                                 long long shift_bs, const void *mix, int K, void *out, void *stream) {
    if (B <= 0 || T <= 0 || K <= 0) return 0;
    if (C % 4) return -1;
    const long long n4 = (long long)B * T * C / 4;
    long long blocks = (n4 + wkv7::prefill::MIX_THREADS - 1) / wkv7::prefill::MIX_THREADS;
    blocks = blocks > 65536 ? 65536 : blocks;
    return WKV7_F_DISPATCH(f_dt, {
        return (int)rwkv_pdl::launch_pdl(prefill::token_mix_kernel<F>, dim3((int)blocks), dim3(prefill::MIX_THREADS), 0,
                                         (cudaStream_t)stream, (const F *)x, (const F *)shift, shift_bs, (const F *)mix,
                                         (F *)out, T, C, K, n4);
    });
}

// rows x C (C = H * head size) contiguous rows of f_dt for every activation; the per-channel
// constants (C,) contiguous. vz, v_first, v0: null in layer 0 (v is then left as it is). Writes
// w over wz, k' over k, v' over v, a = -kk over az, and b (rows x C).
extern "C" int prefill_tmix_prep(int f_dt, long long rows, int H, void *k, void *v, void *wz, void *az,
                                 const void *vz, const void *v_first, const void *w0, const void *a0,
                                 const void *v0, const void *k_k, const void *k_a, const void *k_a1, void *b,
                                 void *stream) {
    if (rows <= 0) return 0;
    if ((vz == nullptr) != (v_first == nullptr) || (vz && !v0)) return -1;
    wkv7::prefill::PrepArgs p{v_first, vz, w0, a0, v0, k_k, k_a, k_a1, k, v, wz, az, b, rows, H};
    const int blocks = wkv7::prefill::blocks_for(rows * H);
    return WKV7_F_DISPATCH(f_dt, {
        return (int)rwkv_pdl::launch_pdl(prefill::tmix_prep_kernel<F>, dim3(blocks), dim3(prefill::WARPS * 32), 0,
                                         (cudaStream_t)stream, p);
    });
}

// y, r, k, v, g, out: rows x C contiguous rows of f_dt; r_k (H, N), lnx_w, lnx_b (C,) contiguous.
extern "C" int prefill_tmix_post(int f_dt, long long rows, int H, const void *y, const void *r, const void *k,
                                 const void *v, const void *g, const void *r_k, const void *lnx_w,
                                 const void *lnx_b, float eps, void *out, void *stream) {
    if (rows <= 0) return 0;
    wkv7::prefill::PostArgs p{y, r, k, v, g, r_k, lnx_w, lnx_b, out, rows, H, eps};
    const int blocks = wkv7::prefill::blocks_for(rows * H);
    return WKV7_F_DISPATCH(f_dt, {
        return (int)rwkv_pdl::launch_pdl(prefill::tmix_post_kernel<F>, dim3(blocks), dim3(prefill::WARPS * 32), 0,
                                         (cudaStream_t)stream, p);
    });
}
