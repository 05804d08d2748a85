// Shared by the decode time-mix kernels (wkv7_tmix.cu: split path, wkv7_tmix_fused.cu: one launch).
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
    int early;  // fused kernel: the per-head weight vectors loaded before pdl_wait (pdl.cuh)
};

// The pipelined large-batch kernel (wkv7_tmix_pipe.cu): stages = 2 or 3 shared-memory slots per block,
// mma = the tensor-core row phase where it applies;
// returns -2 where it does not apply (unaligned inputs), else a cudaError_t value.
int tmix_pipe_launch(int f_dt, int s_dt, int stages, bool mma, void *state, long long s_bstride, int B, int H,
                     const TmixArgs &p, cudaStream_t stream);

__device__ __forceinline__ float sigmoidf(float x) { return 1.f / (1.f + expf(-x)); }
__device__ __forceinline__ float softplusf(float x) { return x > 20.f ? x : log1pf(expf(x)); }

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

}  // namespace wkv7
