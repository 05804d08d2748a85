// RWKV-7 time-mix core for one decode token: everything between the projections
// (r, k, v, LoRA outputs) and the output projection. Shared by the decode time-mix kernels
// (wkv7_tmix_fused.cu: a head per block, wkv7_tmix_pipe.cu: persistent pipelined blocks).
//
// Inputs wz, az, vz are the LoRA outputs, with their biases (w0, a0, v0) already added or, when
// the w0/a0/v0 pointers are set, added here (rounded to F first, as torch's add would).
// Per (b, h), with c a column of the head and i a row (value index):
//   a_c   = sigmoid(az)                  w_c = -softplus(-wz) - 0.5;  decay = exp(-exp(w))
//   kk    = normalize_head(k * k_k)      k' = k * (1 + (a - 1) * k_a)
//   v_i   = layer0 ? v : lerp(v, v_first, sigmoid(vz))
//   S     = S diag(decay) + (S (-kk)) (kk a)^T + v k'^T        y = S r     (state in place)
//   out_i = (groupnorm_head(y)_i * lnx_w + lnx_b + (sum_c r k' r_k) v_i) * g_i
// Activations: (B, C) rows with stride act_bstride.
#pragma once
#include "wkv7_common.cuh"

namespace wkv7 {

struct TmixArgs {
    const void *r, *k, *v, *wz, *az, *vz, *v_first, *g;
    const void *k_k, *k_a, *r_k, *lnx_w, *lnx_b;
    void *out;
    const void *w0, *a0, *v0;  // optional LoRA biases (nullptr: already in wz, az, vz)
    long long act_bstride, out_bstride;
    int layer0;
    float gn_eps;
};

// The pipelined large-batch kernel for a 16-bit state (wkv7_tmix_pipe.cu); returns -2 where it
// does not apply (fp32 state, head size other than 64, unaligned inputs), else a cudaError_t value.
int tmix_pipe_launch(int f_dt, int s_dt, void *state, long long s_bstride, int B, int H, const TmixArgs &p,
                     int per_sm_cap, cudaStream_t stream);

__device__ __forceinline__ float sigmoidf(float x) { return 1.f / (1.f + expf(-x)); }
__device__ __forceinline__ float softplusf(float x) { return x > 20.f ? x : log1pf(expf(x)); }

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

}  // namespace wkv7
