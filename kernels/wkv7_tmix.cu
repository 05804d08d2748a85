// RWKV-7 time-mix core for one decode token: everything between the projections
// (r, k, v, LoRA outputs) and the output projection.
//
// Inputs wz, az, vz are the LoRA outputs, with their biases (w0, a0, v0) already added or, when
// the w0/a0/v0 pointers are set, added here (rounded to F first, as torch's add would).
// Per (b, h), with c a column of the head and i a row (value index):
//   a_c   = sigmoid(az)                  w_c = -softplus(-wz) - 0.5;  decay = exp(-exp(w))
//   kk    = normalize_head(k * k_k)      k' = k * (1 + (a - 1) * k_a)
//   v_i   = layer0 ? v : lerp(v, v_first, sigmoid(vz))
//   S     = S diag(decay) + (S (-kk)) (kk a)^T + v k'^T        y = S r     (state in place)
//   out_i = (groupnorm_head(y)_i * lnx_w + lnx_b + (sum_c r k' r_k) v_i) * g_i
// Two implementations: wkv7_tmix_fused (one launch, a head per 128-thread block; the default at
// every batch size) and the split path (prep -> wkv7_decode -> post; head sizes the fused kernel
// does not cover, or RWKV_TMIX_MODE=split). Activations: (B, C) rows with stride act_bstride.
#include "wkv7_tmix.cuh"

// ---- split path for large batches: prep -> wkv7_decode (fp32 activations) -> post ----------
// (An earlier one-launch kernel with 512-thread blocks held through three barriers reached only
// 2.2 TB/s of state bandwidth at B=1024 vs 3.7 for wkv7_decode, hence this split.) The
// per-column math runs in a small prep kernel, the state update in the plain decode kernel, and
// GroupNorm + bonus + gate in a small post kernel.
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
