// Programmatic dependent launch (PDL, sm_90+) for the decode step's small kernels.
//
// A kernel launched with launch_pdl() may be scheduled while its predecessor in the stream (or
// the CUDA graph) is still draining, so its blocks are resident when the predecessor ends and
// the launch latency between the two is hidden. Such a kernel must call pdl_wait() before its
// first global memory access, read or write: it returns once the predecessor has completed and
// its writes are visible (no kernel here triggers early), so the results are the same as with a
// plain launch. Plain launches on GPUs before sm_90 and with RWKV_PDL=0 (read once per device).
#pragma once
#include <cuda_runtime.h>
#include <stdlib.h>

namespace rwkv_pdl {

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

inline bool pdl_enabled() {
    static int state[64] = {};  // per device: 0 unknown, 1 on, 2 off
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) return false;
    int &s = state[dev & 63];
    if (s == 0) {
        const char *env = getenv("RWKV_PDL");
        int major = 0;
        if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) major = 0;
        s = (major >= 9 && !(env && env[0] == '0')) ? 1 : 2;
    }
    return s == 1;
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
