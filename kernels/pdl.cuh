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
// cuBLAS kernels do not trigger: a kernel after a GEMM starts when the GEMM ends, as with a plain launch.
// add_ln_mix and the time-mix kernels also read their weight vectors (LayerNorm / mix rows,
// per-head constants) before pdl_wait(): weights are never written by a kernel in flight, so this
// is the rule above, and it takes their (cold, HBM) round trip off the path after the wait.
// GPUs before sm_90 get plain launches (decided per device by its compute capability).
#pragma once
#include <cuda_runtime.h>

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

// Test hook (pdl_mode in fused_elementwise.cu): 0 forces plain launches, as GPUs before sm_90
// get, so that the tests can compare the two on one GPU; 1 (the default) uses PDL where supported.
inline int &pdl_switch() {
    static int v = 1;
    return v;
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
