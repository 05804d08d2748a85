// Small-batch gemv over 8-bit weights with the weights streamed through a shared-memory ring by
// bulk copies (TMA, sm_90+): gemv.cu's cfg 4. Included by gemv.cu (uses its Args, mma,
// codes_to_h4, relu2_8, ld_ro and from_f); same product, same MMA lane map.
//
// Why: the register kernel's bytes in flight are its registers' (one step of loads per warp), so a
// projection is a few dependent round trips per warp plus a ramp and a tail, and the next
// projection's kernel cannot start reading until it is resident, which the register-heavy grid
// does not allow before the current one drains. Here one block per SM (16 consumer warps + 1
// producer warp, a 64 KB ring) keeps up to 64 KB of weights in flight per SM from one thread's
// copies, and leaves room on the SM for the NEXT projection's block: launched early by PDL, its
// producer fills its own ring before the PDL wait (weights are never written), so the HBM stream
// does not stop at the boundary between projections.
//
// Work: tile = 8 output rows of one plane (planes flattened: tile t is plane t / tpp). Block b
// takes tiles [b*T/G, (b+1)*T/G). A stage = the tile's 8 rows x SK codes (ktc k-tiles of 64):
// the whole rows in ONE copy where 8 rows fit a stage (K <= 4096; the rows are contiguous), else
// 8 copies of SK bytes into rows SK + 16 bytes apart (small copies cost the copy engine far more
// than their bytes: 640-byte copies ran at ~0.8 TB/s). x (every plane and row) is copied once
// per block after the PDL wait. Consumer warp w takes k-tiles w, w + 16, ... of each stage;
// its lane (g, t) reads 16 codes of weight row g from shared memory and 16 x values of batch row
// g from global (L1), 4 MMAs, as gemv_kernel. At a tile's end the 16 warps' partials meet in
// shared memory (double-buffered by tile parity, one named barrier among the consumers) and 8M
// outputs are written with their scales.
#pragma once
#include "bulk.cuh"
#include "pdl.cuh"

namespace gemv_k {
namespace bulkv {

constexpr int CW = 16;                  // consumer warps (the MMA and code-conversion work needs ~4 per scheduler)
constexpr int THREADS = (CW + 1) * 32;  // + the producer warp
constexpr int RING = 64 * 1024;         // bytes of stages per block
constexpr int MAX_S = 16;               // stages at most
constexpr int STAGE_MAX = 32 * 1024;    // bytes of one stage at most
constexpr int MAX_KTC = 64;             // k-tiles per stage at most (4,096 codes per row)
constexpr int MAX_X = 48 * 1024;        // bytes of x (all planes and rows, skewed) in shared memory at most

struct Plan {
    int tpp, ktc, C, S, P, G;  // tiles per plane, k-tiles per stage, stages per tile, ring stages, planes, blocks
    int SKP;                   // bytes between a stage's rows: K (one contiguous copy) or SK + 16
    int XRS;                   // bytes between x rows in shared memory (K * 2 + 16: the skew spreads banks)
};

template <bool RELU2, int WQ>
__global__ void __launch_bounds__(THREADS) gemv_bulk_kernel(Args a, Plan pl) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    using namespace rwkv_bulk;
    extern __shared__ __align__(128) unsigned char ring[];  // S stages x 8 rows x SKP bytes, then x
    __shared__ __align__(8) uint64_t full[MAX_S], empty[MAX_S], xbar;
    __shared__ float red[2][CW][MAX_M][8];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int SK = pl.ktc * 64, SKP = pl.SKP, ST = 8 * SKP;
    unsigned char *xs = ring + pl.S * ST;  // x[p][m] at (p * M + m) * XRS, fp16
    const long long T = (long long)pl.P * pl.tpp;
    const int t0 = (int)(blockIdx.x * T / pl.G), t1 = (int)((blockIdx.x + 1) * T / pl.G);
    const int n_st = (t1 - t0) * pl.C;  // stages this block streams
    if (threadIdx.x == 0) {
        for (int s = 0; s < pl.S; s++) mbar_init(&full[s], 1), mbar_init(&empty[s], CW);
        mbar_init(&xbar, 1);
        mbar_init_fence();
    }
    __syncthreads();

    if (warp == CW) {  // producer: one thread issues every copy
        if (lane != 0) return;
        const unsigned char *w = static_cast<const unsigned char *>(a.w);
        // x, every plane and row: only after the PDL wait (the predecessor writes it)
        auto issue_x = [&]() {
            rwkv_pdl::pdl_wait();
            mbar_expect_tx(&xbar, (uint32_t)(pl.P * a.M * a.K * 2));
            for (int p = 0; p < pl.P; p++)
                for (int m = 0; m < a.M; m++)
                    bulk_load(xs + (p * a.M + m) * pl.XRS, static_cast<const __half *>(a.x) + p * a.x_ps + m * a.x_s,
                              a.K * 2, &xbar);
        };
        const int pre = n_st < pl.S ? n_st : pl.S;  // the weight stages issued before the wait
        for (int i = 0; i < n_st; i++) {
            if (i == pre) issue_x();
            const int slot = i % pl.S;
            if (i >= pl.S) mbar_wait(&empty[slot], ((i / pl.S) - 1) & 1);
            const int tile = t0 + i / pl.C, c = i % pl.C;
            const int p = tile / pl.tpp, r0 = (tile % pl.tpp) * 8;
            const int nr = min(8, a.N - r0);
            mbar_expect_tx(&full[slot], (uint32_t)(nr * SK));
            const unsigned char *src = w + (long long)p * a.w_ps + (long long)r0 * a.K + (long long)c * SK;
            if (pl.C == 1)  // the tile's rows are contiguous: one copy
                bulk_load(ring + slot * ST, src, nr * SK, &full[slot]);
            else
                for (int r = 0; r < nr; r++)
                    bulk_load(ring + slot * ST + r * SKP, src + (long long)r * a.K, SK, &full[slot]);
        }
        if (pre == n_st) issue_x();
        return;
    }

    // consumers: the wait before any write (pdl.cuh); x arrives on xbar
    rwkv_pdl::pdl_wait();
    rwkv_pdl::pdl_trigger();
    const int g = lane >> 2, t = lane & 3;
    const bool xok = g < a.M;
    constexpr int KPW = (MAX_KTC + CW - 1) / CW;  // k-tiles per warp per stage at most
    mbar_wait(&xbar, 0);
    for (int lt = 0; lt < t1 - t0; lt++) {
        const int tile = t0 + lt, p = tile / pl.tpp, r0 = (tile % pl.tpp) * 8;
        const unsigned char *xr = xs + (p * a.M + (xok ? g : 0)) * pl.XRS + t * 32;  // 16 x values
        float acc[4][4] = {};
        for (int c = 0; c < pl.C; c++) {
            const int i = lt * pl.C + c, slot = i % pl.S;
            mbar_wait(&full[slot], (i / pl.S) & 1);
            const unsigned char *st = ring + slot * ST + g * SKP + t * 16;
#pragma unroll
            for (int u = 0; u < KPW; u++) {
                const int j = warp + u * CW;
                if (j >= pl.ktc) break;
                const uint4 wv = *reinterpret_cast<const uint4 *>(st + j * 64);
                const unsigned char *xp = xr + (c * SK + j * 64) * 2;
                uint4 xv[2] = {make_uint4(0, 0, 0, 0), make_uint4(0, 0, 0, 0)};
                if (xok) xv[0] = *reinterpret_cast<const uint4 *>(xp), xv[1] = *reinterpret_cast<const uint4 *>(xp + 16);
                if constexpr (RELU2) xv[0] = relu2_8<__half>(xv[0]), xv[1] = relu2_8<__half>(xv[1]);
                const uint32_t wc[4] = {wv.x, wv.y, wv.z, wv.w};
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    const uint2 h = codes_to_h4<WQ>(wc[q]);
                    const uint4 &xq = xv[q >> 1];
                    mma<false>(acc[q], (q & 1) ? xq.z : xq.x, (q & 1) ? xq.w : xq.y, h.x, h.y);
                }
            }
            __syncwarp();
            if (lane == 0) mbar_arrive(&empty[slot]);
        }
        float (*rb)[MAX_M][8] = red[lt & 1];
        rb[warp][g][2 * t] = acc[0][0] + acc[1][0] + acc[2][0] + acc[3][0];
        rb[warp][g][2 * t + 1] = acc[0][1] + acc[1][1] + acc[2][1] + acc[3][1];
        asm volatile("bar.sync 1, %0;" ::"r"(CW * 32) : "memory");
        const int tid = threadIdx.x;
        if (tid < a.M * 8) {
            const int m = tid >> 3, j = tid & 7, n = r0 + j;
            if (n < a.N) {
                float s = 0.f;
#pragma unroll
                for (int v = 0; v < CW; v++) s += rb[v][m][j];
                s *= a.scale[p * a.s_ps + n];
                static_cast<__half *>(a.out)[p * a.o_ps + m * a.o_s + n] = from_f<__half>(s);
            }
        }
    }
#endif
}

// The plan for N x K codes in P planes, or false (K not a multiple of 64: the register kernel).
inline bool plan(const Args &a, int P, int sms, Plan &pl) {
    if (a.K % 64 || a.M > MAX_M) return false;
    const int KT = a.K / 64;
    int ktc = 1;  // whole rows when a tile fits a stage (one copy), else the largest divisor that fits
    for (int d = MAX_KTC; d >= 1; d--)
        if (KT % d == 0 && 8 * (d * 64 + (d == KT ? 0 : 16)) <= STAGE_MAX) { ktc = d; break; }
    pl.ktc = ktc, pl.C = KT / ktc, pl.tpp = (a.N + 7) / 8, pl.P = P;
    pl.SKP = pl.C == 1 ? a.K : ktc * 64 + 16;
    pl.S = RING / (8 * pl.SKP);
    pl.S = pl.S > MAX_S ? MAX_S : pl.S;
    pl.XRS = a.K * 2 + 16;
    if ((long long)P * a.M * pl.XRS > MAX_X) return false;
    const long long T = (long long)P * pl.tpp;
    pl.G = (int)(T < sms ? T : sms);
    return pl.S >= 2;
}

template <bool RELU2, int WQ>
int launch(const Args &a, int P, cudaStream_t s) {
    static const int sms = sm_count();
    Plan pl;
    if (!plan(a, P, sms, pl)) return UNSUPPORTED;
    const size_t smem = (size_t)pl.S * 8 * pl.SKP + (size_t)P * a.M * pl.XRS;
    static const cudaError_t attr = cudaFuncSetAttribute(gemv_bulk_kernel<RELU2, WQ>,
                                                         cudaFuncAttributeMaxDynamicSharedMemorySize, RING + MAX_X);
    if (attr != cudaSuccess) return (int)attr;
    return (int)rwkv_pdl::launch_pdl(gemv_bulk_kernel<RELU2, WQ>, dim3(pl.G), dim3(THREADS), smem, s, a, pl);
}

}  // namespace bulkv
}  // namespace gemv_k
