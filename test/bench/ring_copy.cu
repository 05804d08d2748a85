// Probe for bench_ring_partition.py (not a server kernel): how much HBM bandwidth an in-place
// read + write stream reaches on n SMs when each CTA keeps a deep ring of bulk copies (TMA) in
// flight, the shape a time-mix on a share of the SMs would need. One thread per CTA drives the
// ring: load chunk i into slot i % S (mbarrier), store it back from the slot (bulk_group), refill
// the slot once its store has read it. COMPUTE = 1: 4 warps scale every element (fp16 x2);
// COMPUTE = 2: ~the WKV's arithmetic per element (six fp32 FMAs, a row sum by shuffles).
// Built by the script with nvcc for sm_90a (bulk copies need Hopper).
#include <cstdint>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

__device__ __forceinline__ uint32_t saddr(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mbar_init(uint64_t *b, uint32_t c) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(saddr(b)), "r"(c) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t *b, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(saddr(b)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t *b, uint32_t par) {
    asm volatile("{\n.reg .pred P1;\nW:\nmbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n@P1 bra D;\nbra W;\nD:\n}\n" ::"r"(saddr(b)), "r"(par) : "memory");
}
__device__ __forceinline__ void bulk_load(void *dst, const void *src, uint32_t n, uint64_t *b) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(saddr(dst)), "l"(src), "r"(n), "r"(saddr(b)) : "memory");
}
__device__ __forceinline__ void bulk_store(void *dst, const void *src, uint32_t n) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(saddr(src)), "r"(n) : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
template <int K> __device__ __forceinline__ void wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(K) : "memory");
}

template <int S, int LA, int COMPUTE>
__global__ void ring_copy(char *buf, long long chunks, int chunk) {
    extern __shared__ __align__(128) unsigned char dyn[];
    __shared__ __align__(8) uint64_t bars[S];
    const long long first = blockIdx.x, step = gridDim.x;
    const long long mine = first < chunks ? (chunks - 1 - first) / step + 1 : 0;
    if (threadIdx.x == 0) {
        for (int s = 0; s < S; s++) mbar_init(&bars[s], 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    auto gaddr = [&](long long i) { return buf + (first + i * step) * (long long)chunk; };
    if (threadIdx.x == 0)
        for (long long i = 0; i < LA && i < mine; i++) {
            mbar_expect_tx(&bars[i % S], chunk);
            bulk_load(dyn + (i % S) * chunk, gaddr(i), chunk, &bars[i % S]);
        }
    for (long long i = 0; i < mine; i++) {
        const int s = i % S;
        if (COMPUTE) {
            mbar_wait(&bars[s], (i / S) & 1);
            __half2 *p = (__half2 *)(dyn + s * chunk);
            if (COMPUTE == 1) {
                for (int e = threadIdx.x; e < chunk / 4; e += blockDim.x) p[e] = __hmul2(p[e], __float2half2_rn(1.0001f));
            } else {  // ~WKV: six fp32 FMAs per element, a row sum by shuffles
                const float w = 0.999f, a = 1e-3f * threadIdx.x, b = 2e-3f, v = 3e-3f, k = 4e-3f, r = 5e-3f;
                float acc = 0.f;
                for (int e = threadIdx.x; e < chunk / 4; e += blockDim.x) {
                    float2 f = __half22float2(p[e]);
                    f.x = fmaf(f.x, w, fmaf(a, b, fmaf(v, k, 0.f))); f.y = fmaf(f.y, w, fmaf(a, b, fmaf(v, k, 0.f)));
                    acc = fmaf(f.x, r, fmaf(f.y, r, acc));
                    p[e] = __float22half2_rn(f);
                }
                for (int o = 16; o; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
                if ((threadIdx.x & 31) == 0 && acc == 12345.f) p[0] = __float2half2_rn(acc);
            }
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
            __syncthreads();
        }
        if (threadIdx.x == 0) {
            if (!COMPUTE) mbar_wait(&bars[s], (i / S) & 1);
            bulk_store(gaddr(i), dyn + s * chunk, chunk);
            const long long j = i + LA;
            if (j < mine) {
                wait_read<S - LA>();  // the store of chunk j - S has read its slot
                mbar_expect_tx(&bars[j % S], chunk);
                bulk_load(dyn + (j % S) * chunk, gaddr(j), chunk, &bars[j % S]);
            }
        }
    }
    if (threadIdx.x == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

template <int S, int LA, int C>
static int launch_t(void *buf, long long bytes, int chunk, int grid, int threads, cudaStream_t st) {
    const int smem = S * chunk;
    cudaFuncSetAttribute(ring_copy<S, LA, C>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    ring_copy<S, LA, C><<<grid, threads, smem, st>>>((char *)buf, bytes / chunk, chunk);
    return (int)cudaGetLastError();
}

extern "C" int ring_copy_launch(void *buf, long long bytes, int chunk, int grid, int cfg, int compute, void *stream) {
    cudaStream_t st = (cudaStream_t)stream;
    const int th = compute ? 128 : 32;  // the ring alone: one warp
    switch (cfg * 3 + compute) {
        case 0: return launch_t<4, 2, 0>(buf, bytes, chunk, grid, th, st);
        case 1: return launch_t<4, 2, 1>(buf, bytes, chunk, grid, th, st);
        case 2: return launch_t<4, 2, 2>(buf, bytes, chunk, grid, th, st);
        case 3: return launch_t<6, 4, 0>(buf, bytes, chunk, grid, th, st);
        case 4: return launch_t<6, 4, 1>(buf, bytes, chunk, grid, th, st);
        case 5: return launch_t<6, 4, 2>(buf, bytes, chunk, grid, th, st);
        case 6: return launch_t<8, 6, 0>(buf, bytes, chunk, grid, th, st);
        case 7: return launch_t<8, 6, 1>(buf, bytes, chunk, grid, th, st);
        case 8: return launch_t<8, 6, 2>(buf, bytes, chunk, grid, th, st);
        case 9: return launch_t<12, 8, 0>(buf, bytes, chunk, grid, th, st);
        case 10: return launch_t<12, 8, 1>(buf, bytes, chunk, grid, th, st);
        case 11: return launch_t<12, 8, 2>(buf, bytes, chunk, grid, th, st);
    }
    return -1;
}
