// Fused RWKV-7 time-mix core for one decode token: everything between the projections
// (r, k, v, LoRA outputs) and the output projection, in one launch per layer.
//
// Inputs wz, az, vz are the LoRA outputs, with their biases (w0, a0, v0) already added or, when
// the w0/a0/v0 pointers are set, added here (rounded to F first, as torch's add would).
// Per (b, h), with c a column of the head and i a row (value index):
//   a_c   = sigmoid(az)                  w_c = -softplus(-wz) - 0.5;  decay = exp(-exp(w))
//   kk    = normalize_head(k * k_k)      k' = k * (1 + (a - 1) * k_a)
//   v_i   = layer0 ? v : lerp(v, v_first, sigmoid(vz))
//   S     = S diag(decay) + (S (-kk)) (kk a)^T + v k'^T        y = S r     (state in place)
//   out_i = (groupnorm_head(y)_i * lnx_w + lnx_b + (sum_c r k' r_k) v_i) * g_i
// grid (H, B), block 512 = 64 rows x 8 lanes (N = 64): per-column vectors are computed once per
// block into shared memory, rows update their state slice in registers (wkv7_common.cuh), and
// the head's GroupNorm is a block reduction. Activations: (B, C) rows with stride act_bstride.
#include "wkv7_common.cuh"

namespace wkv7 {

constexpr int TM_THREADS = N * TPR;  // 512 for N = 64

struct TmixArgs {
    const void *r, *k, *v, *wz, *az, *vz, *v_first, *g;
    const void *k_k, *k_a, *r_k, *lnx_w, *lnx_b;
    void *out;
    const void *w0, *a0, *v0;  // optional LoRA biases (nullptr: already in wz, az, vz)
    long long act_bstride, out_bstride;
    int layer0;
    float gn_eps;
};

__device__ __forceinline__ float sigmoidf(float x) { return 1.f / (1.f + expf(-x)); }
__device__ __forceinline__ float softplusf(float x) { return x > 20.f ? x : log1pf(expf(x)); }

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

template <typename F, typename S>
__global__ void __launch_bounds__(TM_THREADS) tmix_decode_kernel(S *__restrict__ state, long long s_bstride,
                                                                 int H, TmixArgs p) {
    __shared__ __align__(16) float sh_dec[N], sh_k[N], sh_a[N], sh_b[N], sh_r[N], sh_y[N];
    __shared__ float red[8];
    const int h = blockIdx.x, bi = blockIdx.y, tid = threadIdx.x;
    const int row = tid / TPR, lane = tid % TPR;
    const long long base = (long long)bi * p.act_bstride + (long long)h * N;
    const int hc = h * N;
    auto ld = [&](const void *ptr, long long i) { return to_f(((const F *)ptr)[i]); };
    auto lora = [&](const void *ptr, const void *bias, long long i, int c) {
        return bias ? to_f(from_f<F>(ld(ptr, i) + ld(bias, c))) : ld(ptr, i);
    };

    // the row's state slice and per-row inputs first: their loads overlap phase 1
    S *srow = state + (long long)bi * s_bstride + ((long long)h * N + row) * N;
    float s[EPT];
    load_state<S>(srow, lane, s);
    const float vr = ld(p.v, base + row), gi = ld(p.g, base + row);
    const float vf = p.layer0 ? vr : ld(p.v_first, base + row);
    const float vz = p.layer0 ? 0.f : lora(p.vz, p.v0, base + row, hc + row);
    const float lw = ld(p.lnx_w, hc + row), lb = ld(p.lnx_b, hc + row);

    // phase 1: per-column vectors (threads 0..N-1, one column each)
    float kkr = 0.f, agate = 0.f;
    if (tid < N) {
        const int c = tid;
        const float kr = ld(p.k, base + c), rr = ld(p.r, base + c);
        agate = sigmoidf(lora(p.az, p.a0, base + c, hc + c));
        const float w = -softplusf(-lora(p.wz, p.w0, base + c, hc + c)) - 0.5f;
        kkr = kr * ld(p.k_k, hc + c);
        const float kf = kr * (1.f + (agate - 1.f) * ld(p.k_a, hc + c));
        sh_dec[c] = expf(-expf(w));
        sh_k[c] = kf;
        sh_r[c] = rr;
        const float sq = warp_sum(kkr * kkr), bon = warp_sum(rr * kf * ld(p.r_k, hc + c));
        if ((tid & 31) == 0) red[(tid >> 5) * 2] = sq, red[(tid >> 5) * 2 + 1] = bon;
    }
    __syncthreads();
    if (tid < N) {
        float sq = 0.f;
        for (int wi = 0; wi < N / 32; wi++) sq += red[wi * 2];
        const float kk = kkr / fmaxf(sqrtf(sq), 1e-12f);
        sh_a[tid] = -kk;
        sh_b[tid] = kk * agate;
    }
    __syncthreads();
    float bonus = 0.f;
    for (int wi = 0; wi < N / 32; wi++) bonus += red[wi * 2 + 1];

    // phase 2: the row's state update
    const float vi = p.layer0 ? vr : vr + (vf - vr) * sigmoidf(vz);
    float wv[EPT], kv[EPT], av[EPT], bv[EPT], rv[EPT];
    load_cols<S, float>(sh_dec, lane, wv);
    load_cols<S, float>(sh_k, lane, kv);
    load_cols<S, float>(sh_a, lane, av);
    load_cols<S, float>(sh_b, lane, bv);
    load_cols<S, float>(sh_r, lane, rv);
    const float y = step(s, wv, kv, av, bv, rv, vi);
    store_state<S>(srow, lane, s);
    if (lane == 0) sh_y[row] = y;
    __syncthreads();

    // phase 3: GroupNorm over the head (warp 0), then the output
    if (tid < 32) {
        float x[N / 32], sum = 0.f;
#pragma unroll
        for (int q = 0; q < N / 32; q++) x[q] = sh_y[tid + 32 * q], sum += x[q];
        const float mean = warp_sum(sum) / N;
        float var = 0.f;
#pragma unroll
        for (int q = 0; q < N / 32; q++) var += (x[q] - mean) * (x[q] - mean);
        var = warp_sum(var) / N;
        if (tid == 0) red[6] = mean, red[7] = rsqrtf(var + p.gn_eps);
    }
    __syncthreads();
    if (lane == 0) {
        const float gn = (y - red[6]) * red[7] * lw + lb;
        const float o = (gn + bonus * vi) * gi;
        ((F *)p.out)[(long long)bi * p.out_bstride + hc + row] = from_f<F>(o);
    }
}

}  // namespace wkv7

// Returns a cudaError_t value (0 = success), or -1 for an unsupported dtype combination.
extern "C" int wkv7_tmix_decode(int f_dt, int s_dt, void *state, long long s_bstride, int B, int H,
                                const void *r, const void *k, const void *v, const void *wz, const void *az,
                                const void *vz, const void *v_first, const void *g, long long act_bstride,
                                const void *k_k, const void *k_a, const void *r_k, const void *lnx_w,
                                const void *lnx_b,
                                int layer0, float gn_eps, void *out, long long out_bstride, const void *w0,
                                const void *a0, const void *v0, void *stream) {
    if (B <= 0) return 0;
    wkv7::TmixArgs p{r, k, v, wz, az, vz, v_first, g, k_k, k_a, r_k, lnx_w, lnx_b,
                     out, w0, a0, v0, act_bstride, out_bstride, layer0, gn_eps};
    return WKV7_DISPATCH(f_dt, s_dt, {
        tmix_decode_kernel<F, S><<<dim3(H, B), TM_THREADS, 0, (cudaStream_t)stream>>>((S *)state, s_bstride, H, p);
        return (int)cudaGetLastError();
    });
}

// ---- split path for large batches: prep -> wkv7_decode (fp32 activations) -> post ----------
// The single fused kernel above keeps 512-thread blocks alive through three barriers, which
// caps its state bandwidth (measured 2.2 TB/s at B=1024 vs 3.7 for wkv7_decode). For large B
// the per-column math runs in a small prep kernel, the state update in the plain decode kernel,
// and GroupNorm + bonus + gate in a small post kernel.
//   prep: grid (H, B), block N. Writes fp32 rows (B, C) of buf[0..5] = r, decay, k', v, -kk,
//         kk*a, and bonus (B, H).
//   post: grid (H, B), block N. out = (groupnorm(y) * lnx_w + lnx_b + bonus * v) * g.
namespace wkv7 {

template <typename F>
__global__ void __launch_bounds__(N) tmix_prep_kernel(TmixArgs p, float *__restrict__ buf, long long plane,
                                                      float *__restrict__ bonus, int H) {
    __shared__ float red[2 * (N / 32)];
    const int h = blockIdx.x, bi = blockIdx.y, c = threadIdx.x, hc = h * N;
    const long long base = (long long)bi * p.act_bstride + hc;
    const long long o = (long long)bi * (H * N) + hc + c;
    auto ld = [&](const void *ptr, long long i) { return to_f(((const F *)ptr)[i]); };
    auto lora = [&](const void *ptr, const void *bias, long long i, int cc) {
        return bias ? to_f(from_f<F>(ld(ptr, i) + ld(bias, cc))) : ld(ptr, i);
    };
    const float kr = ld(p.k, base + c), rr = ld(p.r, base + c), vr = ld(p.v, base + c);
    const float agate = sigmoidf(lora(p.az, p.a0, base + c, hc + c));
    const float w = -softplusf(-lora(p.wz, p.w0, base + c, hc + c)) - 0.5f;
    const float kkr = kr * ld(p.k_k, hc + c);
    const float kf = kr * (1.f + (agate - 1.f) * ld(p.k_a, hc + c));
    float vi = vr;
    if (!p.layer0) {
        const float vf = ld(p.v_first, base + c);
        vi = vr + (vf - vr) * sigmoidf(lora(p.vz, p.v0, base + c, hc + c));
    }
    const float sq = warp_sum(kkr * kkr), bon = warp_sum(rr * kf * ld(p.r_k, hc + c));
    if ((c & 31) == 0) red[(c >> 5) * 2] = sq, red[(c >> 5) * 2 + 1] = bon;
    __syncthreads();
    float s2 = 0.f, bsum = 0.f;
#pragma unroll
    for (int wi = 0; wi < N / 32; wi++) s2 += red[wi * 2], bsum += red[wi * 2 + 1];
    const float kk = kkr / fmaxf(sqrtf(s2), 1e-12f);
    buf[o] = rr;
    buf[plane + o] = expf(-expf(w));
    buf[2 * plane + o] = kf;
    buf[3 * plane + o] = vi;
    buf[4 * plane + o] = -kk;
    buf[5 * plane + o] = kk * agate;
    if (c == 0) bonus[(long long)bi * H + h] = bsum;
}

template <typename F>
__global__ void __launch_bounds__(N) tmix_post_kernel(TmixArgs p, const float *__restrict__ y,
                                                      const float *__restrict__ vbuf,
                                                      const float *__restrict__ bonus, int H) {
    __shared__ float red[2 * (N / 32)];
    const int h = blockIdx.x, bi = blockIdx.y, c = threadIdx.x, hc = h * N;
    const long long o = (long long)bi * (H * N) + hc + c;
    const float yi = y[o];
    const float s1 = warp_sum(yi);
    if ((c & 31) == 0) red[c >> 5] = s1;
    __syncthreads();
    float mean = 0.f;
#pragma unroll
    for (int wi = 0; wi < N / 32; wi++) mean += red[wi];
    mean /= N;
    const float d = yi - mean, s2 = warp_sum(d * d);
    __syncthreads();
    if ((c & 31) == 0) red[c >> 5] = s2;
    __syncthreads();
    float var = 0.f;
#pragma unroll
    for (int wi = 0; wi < N / 32; wi++) var += red[wi];
    var /= N;
    auto ld = [&](const void *ptr, long long i) { return to_f(((const F *)ptr)[i]); };
    const float gn = d * rsqrtf(var + p.gn_eps) * ld(p.lnx_w, hc + c) + ld(p.lnx_b, hc + c);
    const float out = (gn + bonus[(long long)bi * H + h] * vbuf[o]) * ld(p.g, (long long)bi * p.act_bstride + hc + c);
    ((F *)p.out)[(long long)bi * p.out_bstride + hc + c] = from_f<F>(out);
}

}  // namespace wkv7

#define WKV7_F_DISPATCH(f_dt, ...)                                              \
    [&]() -> int {                                                              \
        using namespace wkv7;                                                   \
        if (f_dt == DT_F16) { using F = __half; __VA_ARGS__ }                   \
        if (f_dt == DT_BF16) { using F = __nv_bfloat16; __VA_ARGS__ }           \
        if (f_dt == DT_F32) { using F = float; __VA_ARGS__ }                    \
        return -1;                                                              \
    }()

// buf: 6 planes of B*H*N floats (r, decay, k', v, -kk, kk*a); bonus: B*H floats.
extern "C" int wkv7_tmix_prep(int f_dt, int B, int H, const void *r, const void *k, const void *v,
                              const void *wz, const void *az, const void *vz, const void *v_first,
                              long long act_bstride, const void *k_k, const void *k_a, const void *r_k,
                              int layer0, float *buf, float *bonus, const void *w0, const void *a0,
                              const void *v0, void *stream) {
    if (B <= 0) return 0;
    wkv7::TmixArgs p{r, k, v, wz, az, vz, v_first, nullptr, k_k, k_a, r_k, nullptr, nullptr,
                     nullptr, w0, a0, v0, act_bstride, 0, layer0, 0.f};
    const long long plane = (long long)B * H * wkv7::N;
    return WKV7_F_DISPATCH(f_dt, {
        tmix_prep_kernel<F><<<dim3(H, B), N, 0, (cudaStream_t)stream>>>(p, buf, plane, bonus, H);
        return (int)cudaGetLastError();
    });
}

// y, vbuf: (B, H*N) fp32; g: (B, C) rows with stride act_bstride; out: rows with out_bstride.
extern "C" int wkv7_tmix_post(int f_dt, int B, int H, const float *y, const float *vbuf, const float *bonus,
                              const void *g, long long act_bstride, const void *lnx_w, const void *lnx_b,
                              float gn_eps, void *out, long long out_bstride, void *stream) {
    if (B <= 0) return 0;
    wkv7::TmixArgs p{nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, g, nullptr, nullptr,
                     nullptr, lnx_w, lnx_b, out, nullptr, nullptr, nullptr, act_bstride, out_bstride, 0, gn_eps};
    return WKV7_F_DISPATCH(f_dt, {
        tmix_post_kernel<F><<<dim3(H, B), N, 0, (cudaStream_t)stream>>>(p, y, vbuf, bonus, H);
        return (int)cudaGetLastError();
    });
}
