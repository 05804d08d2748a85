// Small-batch projections: out = x @ w^T, w in the nn.Linear layout (N, K) row-major, x (M, K)
// with M <= 8 rows, fp16 or bf16, fp32 accumulation; optionally P stacked planes in one launch
// (plane p: x + p*x_ps, w + p*w_ps, out + p*o_ps). Pure-torch twin: server.model.ops.linear.
//
// Memory bound (each weight byte is read once), so the design is about bytes in flight:
//   * Tensor-core products with the batch as the MMA's M side: mma.m16n8k16 with A = x (rows
//     0..7 = the batch, rows 8..15 zero) and B = 8 weight rows. A lane (g = lane / 4, t = lane % 4)
//     loads ONE 16-byte chunk (8 consecutive k) of weight row g and the same chunk of x row g;
//     the k order inside an MMA is free (A and B use the same map), so a chunk feeds two MMAs
//     (elements 0-3, then 4-7) with no shuffles or conversions. A warp's "k-tile" = 32 k
//     (4 chunks per row: lanes t = 0..3). The sum over the 4 lanes of a row is done by the MMA.
//     D rows 0..7 land as c0, c1 = out[m = g][n = 2t, 2t + 1] (c2, c3: the zero rows).
//     Cost per 16 weight bytes: 2 MMAs at any M (vs 8M FMAs + conversions on the CUDA cores,
//     which at M = 8 would need most of the SM's FP32 issue rate at full HBM bandwidth).
//   * A warp owns RT tiles of 8 weight rows (8*RT rows) and a contiguous slice of the k-tiles;
//     per step it issues all RT*U weight loads and U x loads (16 bytes each, unrolled) before
//     any MMA. Weights go through ld.global.nc.L1::no_allocate (streamed, L2 256-byte
//     prefetch); x through the read-only path (it is re-read by every block: L1/L2 hits).
//   * A block = W warps splitting the K of the same 8*RT rows; fp32 partials are reduced in
//     shared memory (no second pass, no atomics). W is chosen by the host so that the grid
//     (ceil(N / 8RT) x P blocks) holds enough warps to cover 132 SMs.
// act = 1 (relu2): x is read as round(max(x, 0)^2) (the channel-mix activation, as
// ops.relu_square rounds it), so ffn_value's gemv consumes ffn_key's raw output and the separate
// relu_square launch goes away at small batch; every block applies it to its own x loads.
// Zero padding (lim, lim_kind): stacked planes of different widths zero-padded to one shape (the
// decode LoRAs) need not be read past their width. lim packs, for planes 0..7, 8 bits each: the
// plane's width in units of 8 (0 = the whole plane); lim_kind 1: weight rows n >= width are zero
// (their outputs are written as 0 without loading them), 2: weight columns k >= width are zero
// (the loads of x and w stop there). The caller promises the padding is zero, so the result is
// the padded product's (bitwise for finite x: a skipped product would have added exactly 0).
// 8-bit weights (w_dt 1 int8, 2 fp8 e4m3; x and out fp16 only): w holds codes q (N, K), one byte
// each, and scale (N,) fp32 per row (plane p: scale + p*s_ps); out = (x @ q^T) * scale[n], the
// codes converted to fp16 exactly in registers (int8 by the 0x6400 magic-number trick, e4m3 by the
// sm_89+ cvt instruction). A lane's 16-byte weight load then holds 16 k (a "chunk" is 16 k, a
// k-tile 64 k) and feeds 4 MMAs against two 16-byte x loads: half the weight bytes per product.
// Requirements (else GEMV_UNSUPPORTED, the caller falls back to cuBLAS): K % 8 == 0 (16 for 8-bit
// weights), x and w
// 16-byte aligned, x row/plane strides and the w plane stride multiples of 8 elements, 1 <= M
// <= 8, sm_80 or newer. out: any strides (2-byte stores).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

#include "pdl.cuh"

namespace gemv_k {

constexpr int MAX_M = 8;
constexpr int MAX_WARPS = 16;
constexpr int UNSUPPORTED = -2;  // layout/dtype/arch not covered: use the fallback
enum Dtype { DT_F32 = 0, DT_F16 = 1, DT_BF16 = 2 };
enum WType { W_SAME = 0, W_INT8 = 1, W_FP8 = 2 };  // the weights' element type

struct Args {
    const void *x, *w;
    void *out;
    const float *scale;  // 8-bit weights: per-row scales (plane stride s_ps); else unused
    long long x_s, x_ps, w_ps, o_s, o_ps, s_ps;
    int M, N, K;
    unsigned long long lim;  // per-plane widths / 8 (8 bits each, planes 0..7; 0 = whole plane)
    int lim_kind;            // 0 none, 1 rows (N), 2 columns (K)
};

enum LimKind { LIM_NONE = 0, LIM_ROWS = 1, LIM_COLS = 2 };

// the width (elements) that plane p is read to along the limited dimension, or full
__device__ __forceinline__ int plane_limit(const Args &a, int p, int full) {
    if (a.lim_kind == LIM_NONE || p >= 8) return full;
    const int l = (int)((a.lim >> (8 * p)) & 255u) * 8;
    return l == 0 || l > full ? full : l;
}

// 16-byte loads predicated inside the asm (zeros when !ok): straight-line code, so ptxas keeps
// all of a step's loads ahead of the MMAs (with C-level branches it interleaved them).
// GEMV_LD16(QUAL): the predicated 16-byte load "ld.global.<QUAL>.v4.u32" of p into v.
#define GEMV_LD16(QUAL)                                                                     \
    asm("{\n\t.reg .pred q;\n\tsetp.ne.b32 q, %5, 0;\n\t"                              \
        "mov.b32 %0, 0;\n\tmov.b32 %1, 0;\n\tmov.b32 %2, 0;\n\tmov.b32 %3, 0;\n\t"      \
        "@q ld.global." QUAL ".v4.u32 {%0, %1, %2, %3}, [%4];\n\t}"                       \
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)                                        \
        : "l"(p), "r"((int)ok))

__device__ __forceinline__ uint4 ld_stream(const void *p, bool ok) {  // weights: read once
    uint4 v;
    GEMV_LD16("nc.L1::no_allocate.L2::256B");
    return v;
}

__device__ __forceinline__ uint4 ld_ro(const void *p, bool ok) {  // x: re-read by every block
    uint4 v;
    GEMV_LD16("nc");
    return v;
}
#undef GEMV_LD16

// d += A (16x16, rows 8..15 zero: a1 = a3 = 0) * B (16x8)
template <bool BF>
__device__ __forceinline__ void mma(float *d, uint32_t a0, uint32_t a2, uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    const uint32_t z = 0;
    if constexpr (BF) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
            "{%8, %9}, {%0, %1, %2, %3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a0), "r"(z), "r"(a2), "r"(z), "r"(b0), "r"(b1));
    } else {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
            "{%8, %9}, {%0, %1, %2, %3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a0), "r"(z), "r"(a2), "r"(z), "r"(b0), "r"(b1));
    }
#endif
}

// relu(x)^2 of the 8 16-bit values in v, each rounded to F once (torch: relu exact, square in fp32
// then rounded), the same bits as relu_square_kernel writes.
template <typename F>
__device__ __forceinline__ uint32_t relu2_pair(uint32_t u) {
    float2 f;
    if constexpr (std::is_same<F, __half>::value) f = __half22float2(*reinterpret_cast<const __half2 *>(&u));
    else f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(&u));
    f.x = fmaxf(f.x, 0.f), f.y = fmaxf(f.y, 0.f);
    f.x *= f.x, f.y *= f.y;
    if constexpr (std::is_same<F, __half>::value) {
        const __half2 h = __floats2half2_rn(f.x, f.y);
        return *reinterpret_cast<const uint32_t *>(&h);
    } else {
        const __nv_bfloat162 h = __floats2bfloat162_rn(f.x, f.y);
        return *reinterpret_cast<const uint32_t *>(&h);
    }
}
template <typename F>
__device__ __forceinline__ uint4 relu2_8(uint4 v) {
    return make_uint4(relu2_pair<F>(v.x), relu2_pair<F>(v.y), relu2_pair<F>(v.z), relu2_pair<F>(v.w));
}

// 4 weight codes (one byte each, k order) -> 4 fp16 values as two half2 registers (lo: codes 0, 1).
// int8: the bytes with their sign bit flipped sit under exponent byte 0x64: 1024 + (q + 128)
// exactly, minus 1152 -> q. e4m3: the hardware conversion (sm_89+), exact in fp16.
template <int WQ>
__device__ __forceinline__ uint2 codes_to_h4(uint32_t u) {
    uint2 r;
    if constexpr (WQ == W_INT8) {
        const uint32_t v = u ^ 0x80808080u;
        uint32_t lo = __byte_perm(v, 0x64646464u, 0x4140), hi = __byte_perm(v, 0x64646464u, 0x4342);
        const __half2 bias = __half2half2(__ushort_as_half((unsigned short)0x6480));  // 1152
        const __half2 l = __hsub2(*reinterpret_cast<const __half2 *>(&lo), bias);
        const __half2 h = __hsub2(*reinterpret_cast<const __half2 *>(&hi), bias);
        r.x = *reinterpret_cast<const uint32_t *>(&l), r.y = *reinterpret_cast<const uint32_t *>(&h);
    } else {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
        asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r.x) : "h"((unsigned short)(u & 0xffffu)));
        asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r.y) : "h"((unsigned short)(u >> 16)));
#else
        r.x = r.y = 0u;  // never launched: dispatch refuses fp8 below sm_89
#endif
    }
    return r;
}

template <typename F>
__device__ __forceinline__ F from_f(float v);
template <>
__device__ __forceinline__ __half from_f<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// grid (ceil(N / (8*RT)), P), block 32*W threads (W <= MAX_WARPS). WQ: the weights' WType.
template <typename F, int RT, int U, bool RELU2, int WQ>
__global__ void __launch_bounds__(MAX_WARPS * 32) gemv_kernel(Args a) {
    constexpr bool BF = sizeof(F) == 2 && !std::is_same<F, __half>::value;
    constexpr int E = WQ == W_SAME ? 8 : 16;  // k per chunk (one 16-byte weight load)
    constexpr int XL = E / 8;                 // 16-byte x loads per chunk
    constexpr int WB = WQ == W_SAME ? (int)sizeof(F) : 1;  // bytes per weight
    __shared__ float red[MAX_WARPS][MAX_M][8 * RT];  // per-warp partials: [warp][m][row]
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, W = blockDim.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int n0 = blockIdx.x * (8 * RT);
    const int KC = a.K / E;           // chunks per row
    const int KT = (KC + 3) >> 2;     // k-tiles (4 chunks) per row (the split, as for any plane)
    const int KCv = a.lim_kind == LIM_COLS ? plane_limit(a, blockIdx.y, a.K) / E : KC;  // chunks read
    const int Nv = a.lim_kind == LIM_ROWS ? plane_limit(a, blockIdx.y, a.N) : a.N;     // rows read
    const int per = (KT + W - 1) / W; // k-tiles per warp
    const int kb = warp * per;
    const int ke = min(KT, kb + per);

    const char *w = static_cast<const char *>(a.w) + (long long)blockIdx.y * a.w_ps * WB;
    const F *x = static_cast<const F *>(a.x) + (long long)blockIdx.y * a.x_ps;
    const char *wr[RT];
    bool rok[RT];
#pragma unroll
    for (int r = 0; r < RT; r++) {
        const int n = n0 + r * 8 + g;
        rok[r] = n < Nv;  // rows in [Nv, N) load nothing: their outputs are 0
        wr[r] = w + ((long long)(rok[r] ? n : 0) * a.K + t * E) * WB;
    }
    const bool xok = g < a.M;
    const F *xr = x + (xok ? g : 0) * a.x_s + t * E;

    // acc[r][c]: NC independent MMA chains per row tile (4 chains per thread in all), so a step's
    // 2*XL*U*RT MMAs are not one dependent chain; summed at the end.
    constexpr int NC = RT >= 4 ? 1 : 4 / RT;
    float acc[RT][NC][4];
#pragma unroll
    for (int r = 0; r < RT; r++)
#pragma unroll
        for (int c = 0; c < NC; c++) acc[r][c][0] = acc[r][c][1] = acc[r][c][2] = acc[r][c][3] = 0.f;

    // One step = U k-tiles: RT*U weight + XL*U x 16-byte loads. The loads of the next step are
    // issued at the END of the loop body (after this step's MMAs): with nothing after them in the
    // block, ptxas keeps them together (loads followed by their consumers in one block get
    // interleaved with the MMAs, one load in flight at a time). A k-tile is 64 weight bytes.
    uint4 wv[U][RT], xv[U][XL];
    auto load_w = [&](int kt) {
#pragma unroll
        for (int u = 0; u < U; u++) {
            const bool ok = kt + u < ke && (kt + u) * 4 + t < KCv;
#pragma unroll
            for (int r = 0; r < RT; r++) wv[u][r] = ld_stream(wr[r] + (long long)(kt + u) * 64, ok && rok[r]);
        }
    };
    auto load_x = [&](int kt) {
#pragma unroll
        for (int u = 0; u < U; u++) {
            const bool ok = xok && kt + u < ke && (kt + u) * 4 + t < KCv;
#pragma unroll
            for (int l = 0; l < XL; l++) {
                xv[u][l] = ld_ro(xr + (long long)(kt + u) * 4 * E + 8 * l, ok);
                if constexpr (RELU2) xv[u][l] = relu2_8<F>(xv[u][l]);
            }
        }
    };
    auto load_step = [&](int kt) { load_w(kt), load_x(kt); };
    // the weights are never written: the first step's weight loads go out before the wait for
    // the predecessor's x (programmatic dependent launch, pdl.cuh)
    if (kb < ke) load_w(kb);
    rwkv_pdl::pdl_wait();
    rwkv_pdl::pdl_trigger();
    if (kb < ke) load_x(kb);
    for (int kt = kb; kt < ke; kt += U) {
#pragma unroll
        for (int u = 0; u < U; u++) {
#pragma unroll
            for (int r = 0; r < RT; r++) {
                if constexpr (WQ == W_SAME) {
                    mma<BF>(acc[r][(2 * u) % NC], xv[u][0].x, xv[u][0].y, wv[u][r].x, wv[u][r].y);      // 0-3
                    mma<BF>(acc[r][(2 * u + 1) % NC], xv[u][0].z, xv[u][0].w, wv[u][r].z, wv[u][r].w);  // 4-7
                } else {  // 16 codes: k 0-7 against x load 0, k 8-15 against x load 1
                    const uint32_t wc[4] = {wv[u][r].x, wv[u][r].y, wv[u][r].z, wv[u][r].w};
#pragma unroll
                    for (int q = 0; q < 4; q++) {
                        const uint2 h = codes_to_h4<WQ>(wc[q]);
                        const uint4 &xq = xv[u][q >> 1];
                        mma<false>(acc[r][(4 * u + q) % NC], (q & 1) ? xq.z : xq.x, (q & 1) ? xq.w : xq.y, h.x, h.y);
                    }
                }
            }
        }
        if (kt + U < ke) load_step(kt + U);
    }
#pragma unroll
    for (int r = 0; r < RT; r++)
#pragma unroll
        for (int c = 1; c < NC; c++) acc[r][0][0] += acc[r][c][0], acc[r][0][1] += acc[r][c][1];

    // c0, c1 = partial out[m = g][n0 + 8r + 2t + {0, 1}] over this warp's k slice
#pragma unroll
    for (int r = 0; r < RT; r++) {
        red[warp][g][r * 8 + 2 * t] = acc[r][0][0];
        red[warp][g][r * 8 + 2 * t + 1] = acc[r][0][1];
    }
    __syncthreads();
    F *out = static_cast<F *>(a.out) + (long long)blockIdx.y * a.o_ps;
    const float *scale = WQ == W_SAME ? nullptr : a.scale + (long long)blockIdx.y * a.s_ps;
    for (int i = threadIdx.x; i < a.M * 8 * RT; i += blockDim.x) {
        const int m = i / (8 * RT), j = i % (8 * RT);
        if (n0 + j >= a.N) continue;
        float s = 0.f;
        for (int v = 0; v < W; v++) s += red[v][m][j];
        if constexpr (WQ != W_SAME) s *= scale[n0 + j];
        out[m * a.o_s + n0 + j] = from_f<F>(s);
    }
}

// cfg 1: 16 rows per warp, 4 k-tiles per step (8 weight + 4 x loads in flight per lane; 8-bit
// weights: 8 + 8); cfg 2: 8 rows, 8 k-tiles (8 + 8; 8-bit weights: 4 k-tiles, 4 + 8); cfg 3: 32 rows, 2 k-tiles (8 + 2; never picked, kept for sweeps).
constexpr int NCFG = 3;

inline int sm_count() {
    int dev = 0, n = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev))
        return 132;
    return n > 0 ? n : 132;
}

// Warps per block (split of K), the rule a sweep (bench_gemm.py --sweep, graph-timed, cold weights)
// found: (1) the largest W whose warps all get whole steps (k-tiles per warp % U == 0) and whose
// grid is resident in ONE wave (a second, partial wave adds a whole tail); (2) if no such W (big grids:
// the head), whole steps with k-tiles per warp closest to 4 steps; (3) else the largest one-wave W.
inline int pick_warps(int KT, long long blocks, int U, int regs, int sms) {
    const int ra = (regs + 7) / 8 * 8;  // allocation granularity
    auto resident = [&](int W) {
        int b = 65536 / (ra * 32 * W), t = 2048 / (32 * W);
        b = b < t ? b : t;
        return (long long)(b < 32 ? b : 32) * sms;
    };
    int best = 0, dist = 1 << 30;
    for (int W = MAX_WARPS; W >= 1; W--) {
        const int per = (KT + W - 1) / W;
        if ((KT + per - 1) / per != W) continue;  // would leave warps without k-tiles
        if (per % U == 0 && blocks <= resident(W)) return W;
    }
    for (int W = MAX_WARPS; W >= 1; W--) {
        const int per = (KT + W - 1) / W;
        if ((KT + per - 1) / per != W || per % U) continue;
        const int d = per > 4 * U ? per - 4 * U : 4 * U - per;
        if (d < dist) best = W, dist = d;
    }
    if (best) return best;
    for (int W = MAX_WARPS; W >= 1; W--) {
        const int per = (KT + W - 1) / W;
        if ((KT + per - 1) / per == W && blocks <= resident(W)) return W;
    }
    const int w = (KT + U - 1) / U;
    return w < 1 ? 1 : (w > MAX_WARPS ? MAX_WARPS : w);
}

template <typename F, int RT, int U, bool RELU2, int WQ>
int launch(const Args &a, int P, int warps, cudaStream_t s) {
    constexpr int E = WQ == W_SAME ? 8 : 16;
    const int KT = (a.K / E + 3) / 4;
    const int bx = (a.N + 8 * RT - 1) / (8 * RT);
    if (P > 65535) return UNSUPPORTED;
    if (warps <= 0) {
        static const int regs = [] {
            cudaFuncAttributes fa;
            return cudaFuncGetAttributes(&fa, gemv_kernel<F, RT, U, RELU2, WQ>) == cudaSuccess ? fa.numRegs : 128;
        }();
        static const int sms = sm_count();
        warps = pick_warps(KT, (long long)bx * P, U, regs, sms);
    }
    if (warps > MAX_WARPS) return UNSUPPORTED;
    return (int)rwkv_pdl::launch_pdl(gemv_kernel<F, RT, U, RELU2, WQ>, dim3(bx, P), dim3(warps * 32), 0, s, a);
}

template <typename F, bool RELU2, int WQ>
int dispatch(const Args &a, int P, int warps, int cfg, cudaStream_t s) {
    if (cfg == 0) {  // 16-row warps when the grid still has >= 2 blocks per SM, else 8-row warps
        static const int sms = sm_count();
        cfg = (long long)((a.N + 15) / 16) * P >= 2LL * sms ? 1 : 2;
    }
    constexpr int U2 = WQ == W_SAME ? 8 : 4;  // 8-bit weights: twice the x registers per k-tile
    switch (cfg) {
        case 1: return launch<F, 2, 4, RELU2, WQ>(a, P, warps, s);
        case 2: return launch<F, 1, U2, RELU2, WQ>(a, P, warps, s);
        case 3: return launch<F, 4, 2, RELU2, WQ>(a, P, warps, s);
    }
    return UNSUPPORTED;
}

template <typename F, int WQ>
int dispatch_act(const Args &a, int P, int warps, int cfg, int act, cudaStream_t s) {
    return act ? dispatch<F, true, WQ>(a, P, warps, cfg, s) : dispatch<F, false, WQ>(a, P, warps, cfg, s);
}

// The arch this build of kernel WQ runs as: min(PTX version, binary version) x 10, 0 if it cannot
// be queried. The MMA needs sm_80 (the loader's generic compute_75 fallback build compiles the
// kernel body out: report unsupported, never run it); e4m3 codes need the cvt of sm_89+.
template <int WQ>
inline int built_arch() {
    cudaFuncAttributes fa;
    if (cudaFuncGetAttributes(&fa, gemv_kernel<__half, 2, 4, false, WQ>) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    return fa.ptxVersion < fa.binaryVersion ? fa.ptxVersion : fa.binaryVersion;
}

}  // namespace gemv_k

// out (M, N) [P planes] = act(x (M, K)) @ w (N, K)^T. f_dt: 1 fp16, 2 bf16 (x, w, out alike).
// w_dt: 0 = w in f_dt; 1 int8 / 2 fp8 e4m3 codes with per-row fp32 scales (scale, plane stride
// s_ps; f_dt fp16 only). act: 0 = x as is, 1 = round(relu(x)^2). warps / cfg: 0 = automatic
// (nonzero: tuning, see test/bench/bench_gemm.py --sweep). lim / lim_kind: zero padding not to
// read (see the top). Returns 0 (launched), GEMV_UNSUPPORTED (-2: nothing launched, use the
// fallback) or a CUDA error.
extern "C" int gemv(int f_dt, int w_dt, int M, int N, int K, int P, const void *x, long long x_s, long long x_ps,
                    const void *w, long long w_ps, const void *scale, long long s_ps, void *out, long long o_s,
                    long long o_ps, int warps, int cfg, int act, long long lim, int lim_kind, void *stream) {
    using namespace gemv_k;
    if (M == 0 || N == 0 || P == 0) return 0;
    const int E = w_dt == W_SAME ? 8 : 16;
    if (M < 0 || M > MAX_M || N < 0 || K <= 0 || P < 0 || K % E) return UNSUPPORTED;
    if (w_dt < W_SAME || w_dt > W_FP8 || (w_dt != W_SAME && (f_dt != DT_F16 || scale == nullptr || s_ps < 0)))
        return UNSUPPORTED;
    auto al16 = [](const void *q) { return ((uintptr_t)q & 15) == 0; };
    if (!al16(x) || !al16(w) || (M > 1 && x_s % 8) || (P > 1 && (x_ps % 8 || w_ps % (w_dt == W_SAME ? 8 : 16)))) return UNSUPPORTED;
    if (x_s < 0 || x_ps < 0 || w_ps < 0) return UNSUPPORTED;
    static const int arch = built_arch<W_SAME>();
    if (arch < 80) return UNSUPPORTED;
    if (w_dt == W_FP8) {
        static const int arch8 = built_arch<W_FP8>();
        if (arch8 < 89) return UNSUPPORTED;
    }
    if (cfg < 0 || cfg > NCFG || act < 0 || act > 1 || lim_kind < LIM_NONE || lim_kind > LIM_COLS) return UNSUPPORTED;
    Args a{x, w, out, static_cast<const float *>(scale), M > 1 ? x_s : 0, P > 1 ? x_ps : 0, P > 1 ? w_ps : 0,
           o_s, o_ps, P > 1 ? s_ps : 0, M, N, K, (unsigned long long)lim, lim ? lim_kind : (int)LIM_NONE};
    cudaStream_t s = (cudaStream_t)stream;
    if (w_dt == W_INT8) return dispatch_act<__half, W_INT8>(a, P, warps, cfg, act, s);
    if (w_dt == W_FP8) return dispatch_act<__half, W_FP8>(a, P, warps, cfg, act, s);
    if (f_dt == DT_F16) return dispatch_act<__half, W_SAME>(a, P, warps, cfg, act, s);
    if (f_dt == DT_BF16) return dispatch_act<__nv_bfloat16, W_SAME>(a, P, warps, cfg, act, s);
    return UNSUPPORTED;
}
