// Programmatic dependent launch (PDL, sm_90+) for the decode step's small kernels.
//
// A kernel launched with launch_pdl() may start while its predecessor in the stream (or the CUDA
// graph) is still running, once every block of the predecessor has called pdl_trigger() (or
// exited). Until its pdl_wait() returns (the predecessor has COMPLETED and its writes are
// visible), such a kernel may only read memory that the predecessor neither writes nor needs
// unchanged (weights; the layer's own state rows, which only this kernel touches), and write
// nothing. So results equal a plain launch's, while the launch latency and the first loads
// overlap the predecessor's tail. Each kernel here calls pdl_wait() before its first access to
// activations and pdl_trigger() right after it (at most one dependent grid waits at a time).
// cuBLAS kernels do not trigger: a kernel after a GEMM starts when the GEMM ends, as before.
// Plain launches on GPUs before sm_90 and with RWKV_PDL=0 (read once per device).
#pragma once
#include <cuda_runtime.h>

#include "env.cuh"

namespace rwkv_pdl {

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// The switch: -1 = RWKV_PDL (default on), 0 / 1 = set by pdl_mode() (the tests' A/B).
inline int &pdl_switch() {
    static int v = -1;
    return v;
}

// Early weight loads (default on; RWKV_PDL_EARLY=0 or pdl_mode(2) off, pdl_mode(3) on): add_ln_mix
// and the fused time-mix read their weight vectors (LayerNorm / mix rows, per-head constants)
// BEFORE pdl_wait(), beside the loads already issued there. Weights are never written by a kernel
// in flight, so this is the rule above; it takes their (cold, HBM) round trip off the path after
// the wait, where only the activations (just written: L2) remain. Read when a kernel is launched.
inline int &early_switch() {
    static int v = -1;
    return v;
}

inline bool early_loads() {
    if (early_switch() < 0) {
        early_switch() = rwkv_env::env_on("RWKV_PDL_EARLY") ? 1 : 0;
    }
    return early_switch() == 1;
}

inline bool pdl_enabled() {
    static int supported[64] = {};  // per device: 0 unknown, 1 sm_90+, 2 older
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) return false;
    int &s = supported[dev & 63];
    if (s == 0) {
        int major = 0;
        if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) major = 0;
        s = major >= 9 ? 1 : 2;
    }
    if (pdl_switch() < 0) {
        pdl_switch() = rwkv_env::env_on("RWKV_PDL") ? 1 : 0;
    }
    return s == 1 && pdl_switch() == 1;
}

// kernel<<<grid, block, smem, stream>>>(args...) with the PDL attribute where enabled; returns
// the launch's cudaError_t.
template <typename... KArgs, typename... Args>
inline cudaError_t launch_pdl(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                              Args... args) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = pdl_enabled() ? 1 : 0;
    return cudaLaunchKernelEx(&cfg, kernel, static_cast<KArgs>(args)...);
}

}  // namespace rwkv_pdl
