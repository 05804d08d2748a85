// One row's channel-mix value projection that skips the zeros of its activation:
//   out (N) = (relu(x)^2 (K) @ wt (K, N)) * scale (N)
// x fp16 (the FFN key's raw output), wt the value weight stored TRANSPOSED (row k = the k-th
// input's N weights, contiguous): 8-bit codes (int8 or fp8 e4m3) with an fp32 scale per output,
// or fp16 values (no scale); out fp16.
// Pure-torch twin: ops.relu2_linear with the QWeight dequantized (qlinear.dense_native).
//
// Why: relu^2 zeroes about half of a random model's K inputs and most of a trained one's, and a
// zero input's weight row adds nothing. In the usual (N, K) layout a zero input's weights are one
// byte in each of N rows, so a gemv reads them anyway; in the transposed layout they are one
// contiguous row that is simply not read. At one row (B = 1) the step is bound by weight bytes,
// so the bytes skipped are time saved.
//
// Grid (G, S): G groups of 512 outputs (a lane owns 16 consecutive outputs: one 16-byte load of a
// weight row; fp16 weights: 8 outputs, groups of 256), S slices of KS inputs. A block (W warps):
//   1. reads its slice of x after the PDL wait, squares, and compacts the nonzero inputs (index,
//      value) into shared memory in k order (warp ballots and a block prefix: deterministic);
//   2. warp w takes nonzero entries w, w + W, ...; each lane loads its 16 codes of those rows,
//      U rows in flight, and accumulates 16 fp32 sums (codes and x exact in fp32);
//   3. sums the W warps' partials in warp order (shared memory) and stores the block's partial
//      sums (GW fp32) to part[s][group's outputs];
//   4. counts itself in with an atomicInc on its group's counter, which wraps to 0 at S - 1 (so
//      the counters are ready for the next launch without a reset); the block that arrives last
//      sums part[0..S)[n] in slice order, scales and writes out. Slice order makes the result
//      independent of which block comes last: the same bits on every run.
// The workspace (part: S x N fp32, count: G uint32 zeroed once) belongs to one caller that
// never runs two of these launches at once (see server.model.cuda_quant.SparseValue).
// Requirements (else GEMV_UNSUPPORTED: the caller falls back to the gemv): N % 16 == 0, 16-byte
// aligned wt and N, KS a multiple of 32 and <= MAX_KS, S * KS >= K, sm_80+ (fp8: sm_89+).
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "pdl.cuh"

namespace gemv_sparse_k {

constexpr int GW = 512;      // most outputs per group: 32 lanes x 16 (8-bit codes)
constexpr int MAX_KS = 1024; // inputs per slice
constexpr int MAX_WARPS = 16;
constexpr int UNSUPPORTED = -2;
enum WType { W_F16 = 0, W_INT8 = 1, W_FP8 = 2 };
// per weight type: E outputs per lane (one 16-byte load of a row), EB bytes per weight, GWT
// outputs per block group
template <int WQ>
struct WTraits {
    static constexpr int E = WQ == W_F16 ? 8 : 16, EB = WQ == W_F16 ? 2 : 1, GWT = 32 * E;
};

struct Args {
    const __half *x;
    const uint8_t *wt;  // (K, N) codes (or fp16 values)
    const float *scale; // (N,), or null: 1
    __half *out;        // (N,)
    float *part;        // (S, N)
    unsigned *count;    // (G,)
    int N, K, KS, S;
};

// weights, read once; predicated inside the asm (zeros when !ok) so that ptxas keeps a step's
// loads together ahead of their FMAs
__device__ __forceinline__ uint4 ld_stream(const void *p, bool ok) {
    uint4 v;
    asm("{\n\t.reg .pred q;\n\tsetp.ne.b32 q, %5, 0;\n\t"
        "mov.b32 %0, 0;\n\tmov.b32 %1, 0;\n\tmov.b32 %2, 0;\n\tmov.b32 %3, 0;\n\t"
        "@q ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];\n\t}"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p), "r"((int)ok));
    return v;
}

// acc[0..3] += 4 codes (one 32-bit word, k-major bytes = outputs j..j+3) * xv; fp16 weights:
// acc[0..1] += 2 values
template <int WQ>
__device__ __forceinline__ void fma4(float *acc, uint32_t u, float xv) {
    if constexpr (WQ == W_F16) {
        const float2 a = __half22float2(*reinterpret_cast<const __half2 *>(&u));
        acc[0] = fmaf(a.x, xv, acc[0]), acc[1] = fmaf(a.y, xv, acc[1]);
    } else if constexpr (WQ == W_INT8) {
#pragma unroll
        for (int i = 0; i < 4; i++) acc[i] = fmaf((float)(int8_t)(u >> (8 * i)), xv, acc[i]);
    } else {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
        uint32_t lo, hi;
        asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(lo) : "h"((unsigned short)(u & 0xffffu)));
        asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(hi) : "h"((unsigned short)(u >> 16)));
        const float2 a = __half22float2(*reinterpret_cast<const __half2 *>(&lo));
        const float2 b = __half22float2(*reinterpret_cast<const __half2 *>(&hi));
        acc[0] = fmaf(a.x, xv, acc[0]), acc[1] = fmaf(a.y, xv, acc[1]);
        acc[2] = fmaf(b.x, xv, acc[2]), acc[3] = fmaf(b.y, xv, acc[3]);
#endif
    }
}

template <int WQ, int U>
__global__ void __launch_bounds__(MAX_WARPS * 32) gemv_sparse_kernel(Args a) {
    __shared__ unsigned short s_idx[MAX_KS];  // nonzero inputs: offset in the slice
    __shared__ float s_val[MAX_KS];           //   and round(relu(x)^2) as fp32
    __shared__ float s_red[MAX_WARPS][GW];    // per-warp partial sums (GWT of GW used)
    __shared__ int s_cnt[MAX_WARPS];
    __shared__ int s_last;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, W = blockDim.x >> 5;
    const int g = blockIdx.x, s = blockIdx.y;
    const int k0 = s * a.KS, kn = min(a.KS, a.K - k0);  // this slice: inputs [k0, k0 + kn)
    constexpr int E = WTraits<WQ>::E, EB = WTraits<WQ>::EB, GWT = WTraits<WQ>::GWT, STEP = E / 4;
    const int c0 = g * GWT + lane * E;                  // this lane's first output
    const bool cok = c0 < a.N;

    rwkv_pdl::pdl_wait();  // x is the predecessor's output
    rwkv_pdl::pdl_trigger();

    // 1. compaction of the slice's nonzero relu(x)^2, in k order
    int nz = 0;
    for (int base = 0; base < kn; base += blockDim.x) {
        const int i = base + threadIdx.x;
        float v = 0.f;
        if (i < kn) {
            const float h = fmaxf(__half2float(a.x[k0 + i]), 0.f);
            v = __half2float(__float2half_rn(h * h));  // rounded to fp16 as relu_square writes it
        }
        const unsigned m = __ballot_sync(0xffffffffu, v != 0.f);
        if (lane == 0) s_cnt[warp] = __popc(m);
        __syncthreads();
        int off = nz;
        for (int w = 0; w < warp; w++) off += s_cnt[w];
        if (v != 0.f) {
            const int p = off + __popc(m & ((1u << lane) - 1u));
            s_idx[p] = (unsigned short)i, s_val[p] = v;
        }
        for (int w = 0; w < W; w++) nz += s_cnt[w];
        __syncthreads();
    }

    // 2. the nonzero rows' codes, U rows in flight per lane
    float acc[E];  // this lane's E outputs over the warp's entries
#pragma unroll
    for (int j = 0; j < E; j++) acc[j] = 0.f;
    const long long rowb = (long long)a.N * EB;  // bytes per weight row
    const uint8_t *wcol = a.wt + k0 * rowb + (long long)c0 * EB;
    uint4 wv[U];
    float xv[U];
    // the loads of step j0 (entries j0 + u * W); issued at the END of the previous step's body,
    // where nothing after them lets ptxas interleave them with the FMAs (as in gemv.cu)
    auto load = [&](int j0) {
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int j = j0 + u * W;
            const bool ok = j < nz;
            xv[u] = ok ? s_val[j] : 0.f;
            wv[u] = ld_stream(wcol + (ok ? s_idx[j] : 0) * rowb, ok && cok);
        }
    };
    if (warp < nz) load(warp);
    for (int j0 = warp; j0 < nz; j0 += W * U) {
#pragma unroll
        for (int u = 0; u < U; u++) {
            fma4<WQ>(acc + 0 * STEP, wv[u].x, xv[u]);
            fma4<WQ>(acc + 1 * STEP, wv[u].y, xv[u]);
            fma4<WQ>(acc + 2 * STEP, wv[u].z, xv[u]);
            fma4<WQ>(acc + 3 * STEP, wv[u].w, xv[u]);
        }
        if (j0 + W * U < nz) load(j0 + W * U);
    }

    // 3. the block's partial sums, warps summed in order
#pragma unroll
    for (int j = 0; j < E; j += 4)
        *reinterpret_cast<float4 *>(&s_red[warp][lane * E + j]) = make_float4(acc[j], acc[j + 1], acc[j + 2], acc[j + 3]);
    __syncthreads();
    for (int c = threadIdx.x; c < GWT; c += blockDim.x) {
        const int n = g * GWT + c;
        if (n >= a.N) continue;
        float t = 0.f;
        for (int w = 0; w < W; w++) t += s_red[w][c];
        a.part[(long long)s * a.N + n] = t;
    }

    // 4. the last block of the group sums the slices in order
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) s_last = atomicInc(&a.count[g], (unsigned)(a.S - 1)) == (unsigned)(a.S - 1);
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    for (int c = threadIdx.x; c < GWT; c += blockDim.x) {
        const int n = g * GWT + c;
        if (n >= a.N) continue;
        float t = 0.f;
        for (int i = 0; i < a.S; i++) t += __ldcg(a.part + (long long)i * a.N + n);
        a.out[n] = __float2half_rn(a.scale != nullptr ? t * a.scale[n] : t);
    }
}

template <int WQ>
int launch(const Args &a, int warps, cudaStream_t st) {
    constexpr int U = 8;
    const int G = (a.N + WTraits<WQ>::GWT - 1) / WTraits<WQ>::GWT;
    return (int)rwkv_pdl::launch_pdl(gemv_sparse_kernel<WQ, U>, dim3(G, a.S), dim3(warps * 32), 0, st, a);
}

// min(PTX version, binary version) x 10 of this build of the kernel, 0 if it cannot be queried
template <int WQ>
inline int built_arch() {
    cudaFuncAttributes fa;
    if (cudaFuncGetAttributes(&fa, gemv_sparse_kernel<WQ, 8>) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    return fa.ptxVersion < fa.binaryVersion ? fa.ptxVersion : fa.binaryVersion;
}

}  // namespace gemv_sparse_k

// out (N) = (round(relu(x)^2) (K) @ wt (K, N)) * scale: w_dt 0 fp16 values (scale null) / 1 int8 /
// 2 fp8 e4m3 codes; x, out fp16; part (slices x N fp32) and count (ceil(N / group) uint32, group
// 256 outputs for fp16 weights, else 512; zero before the first launch) the caller's workspace; ks inputs per slice (slices * ks >= K); warps per block (1..16). Returns 0,
// GEMV_UNSUPPORTED (-2: nothing launched) or a CUDA error.
extern "C" int gemv_sparse(int w_dt, int N, int K, const void *x, const void *wt, const void *scale, void *out,
                           void *part, void *count, int slices, int ks, int warps, void *stream) {
    using namespace gemv_sparse_k;
    if (N <= 0 || K <= 0 || N % 16 || ks <= 0 || ks % 32 || ks > MAX_KS || slices <= 0) return UNSUPPORTED;
    if ((long long)slices * ks < K || (long long)(slices - 1) * ks >= K || slices > 65535) return UNSUPPORTED;
    if (warps < 1 || warps > MAX_WARPS || ((uintptr_t)wt & 15) || w_dt < W_F16 || w_dt > W_FP8) return UNSUPPORTED;
    if ((w_dt == W_F16) != (scale == nullptr)) return UNSUPPORTED;
    static const int arch_i8 = built_arch<W_INT8>();
    if (arch_i8 < 80) return UNSUPPORTED;
    if (w_dt == W_FP8) {
        static const int arch_f8 = built_arch<W_FP8>();
        if (arch_f8 < 89) return UNSUPPORTED;
    }
    Args a{static_cast<const __half *>(x), static_cast<const uint8_t *>(wt), static_cast<const float *>(scale),
           static_cast<__half *>(out), static_cast<float *>(part), static_cast<unsigned *>(count), N, K, ks, slices};
    cudaStream_t st = (cudaStream_t)stream;
    if (w_dt == W_F16) return launch<W_F16>(a, warps, st);
    return w_dt == W_INT8 ? launch<W_INT8>(a, warps, st) : launch<W_FP8>(a, warps, st);
}
