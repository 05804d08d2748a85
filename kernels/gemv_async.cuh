// Small-batch projections with the weights streamed through a per-warp shared-memory ring of
// cp.async copies (gemv cfg 4 / 5; kernels/gemv.cu has the register kernel, its Args and MMA).
//
// Why: the register kernel holds a step's weight bytes in flight in registers, so the bytes in
// flight per SM are capped by the register file. With 8-bit codes each 16-byte load needs two x
// loads beside it (16 k at 2 bytes each) and the kernels run at 108-128 registers: ~9-12 warps
// per SM and 24-39 KB in flight, where HBM needs ~50 KB per SM; they move 1.6-2.6 TB/s where the
// 16-bit kernels (more, lighter warps) reach 3.5-3.9. Here a copy in flight costs no register:
// each warp keeps S - 1 stages of U k-tiles in flight (2 KB of weights a stage at RT = 2), and the
// weights of the first S - 1 stages are asked for before the PDL wait (weights are never written
// by a kernel in flight), so they stream in during the predecessor's tail.
//
// Ring (dynamic shared memory, per warp, S stages): a stage holds RT*U weight slots of 32 x 16
// bytes (lane l's own chunk of row g of tile r at slot (r*U + u)*32 + l: a lane reads back only
// what it copied, so weights need only cp.async.wait_group) and the x pieces of its U k-tiles,
// (U, XL, M, 4) x 16 bytes (copied by any lane, read by the lanes of row g: __syncwarp after the
// wait). A stage's slot is refilled in the iteration after the one that read it, after the
// __syncwarp that follows that iteration's wait. Copies outside the matrix (the last partial
// stage, padding rows / columns of lim) are zero-filled (src-size 0), so the MMAs stay
// unconditional. Lanes of rows g >= M read x row 0: their MMA rows are never stored.
#pragma once

namespace gemv_k {

__device__ __forceinline__ uint32_t smem_u32(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

// 16 bytes global -> shared, bypassing L1, L2 256-byte prefetch; ok = false writes 16 zeros.
__device__ __forceinline__ void cp16(uint32_t dst, const void *src, bool ok) {
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(ok ? 16 : 0)
                 : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
__device__ __forceinline__ uint4 lds16(uint32_t a) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a));
    return v;
}

// Bytes of one warp's stage (weights, then x) for M rows.
template <int RT, int U, int WQ>
__host__ __device__ constexpr int async_w_bytes() { return RT * U * 32 * 16; }
template <int U, int WQ>
__host__ __device__ inline int async_x_bytes(int M) { return U * (WQ == W_SAME ? 1 : 2) * M * 4 * 16; }

// grid (ceil(N / (8*RT)), P), block 32*W threads; dynamic shared memory W * S * stage bytes.
template <typename F, int RT, int U, int S, bool RELU2, int WQ>
__global__ void __launch_bounds__(MAX_WARPS * 32) gemv_async_kernel(Args a) {
    constexpr bool BF = sizeof(F) == 2 && !std::is_same<F, __half>::value;
    constexpr int E = WQ == W_SAME ? 8 : 16;               // k per chunk (one 16-byte weight copy)
    constexpr int XL = E / 8;                              // 16-byte x pieces per chunk
    constexpr int WB = WQ == W_SAME ? (int)sizeof(F) : 1;  // bytes per weight
    constexpr int WBY = async_w_bytes<RT, U, WQ>();
    extern __shared__ __align__(16) unsigned char ring[];
    __shared__ float red[MAX_WARPS][MAX_M][8 * RT];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, W = blockDim.x >> 5;
    const int g = lane >> 2, t = lane & 3, M = a.M;
    const int n0 = blockIdx.x * (8 * RT);
    const int KC = a.K / E, KT = (KC + 3) >> 2;
    const int KCv = a.lim_kind == LIM_COLS ? (plane_limit(a, blockIdx.y, a.K) + E - 1) / E : KC;
    const int Nv = a.lim_kind == LIM_ROWS ? plane_limit(a, blockIdx.y, a.N) : a.N;
    const int per = (KT + W - 1) / W, kb = warp * per, ke = min(KT, kb + per);
    const int nst = kb < ke ? (ke - kb + U - 1) / U : 0;  // this warp's stages
    const int stage = WBY + async_x_bytes<U, WQ>(M);
    const uint32_t base = smem_u32(ring) + (uint32_t)(warp * S * stage);

    const char *w = static_cast<const char *>(a.w) + (long long)blockIdx.y * a.w_ps * WB;
    const F *x = static_cast<const F *>(a.x) + (long long)blockIdx.y * a.x_ps;
    const char *wr[RT];
    bool rok[RT];
#pragma unroll
    for (int r = 0; r < RT; r++) {
        const int n = n0 + r * 8 + g;
        rok[r] = n < Nv;
        wr[r] = w + ((long long)(rok[r] ? n : 0) * a.K + t * E) * WB;
    }
    auto copy_w = [&](int s) {
        const uint32_t d = base + (uint32_t)((s % S) * stage);
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int kt = kb + s * U + u;
            const bool ok = kt < ke && kt * 4 + t < KCv;
#pragma unroll
            for (int r = 0; r < RT; r++)
                cp16(d + (uint32_t)(((r * U + u) * 32 + lane) * 16), wr[r] + (ok ? (long long)kt * 64 : 0), ok && rok[r]);
        }
    };
    auto copy_x = [&](int s) {  // piece i = ((u * XL + l) * M + m) * 4 + tt
        const uint32_t d = base + (uint32_t)((s % S) * stage + WBY);
        for (int i = lane; i < U * XL * M * 4; i += 32) {
            const int tt = i & 3, m = (i >> 2) % M, l = (i / (4 * M)) % XL, u = i / (4 * M * XL);
            const int kt = kb + s * U + u;
            const bool ok = kt < ke && kt * 4 + tt < KCv;
            const F *src = x + (ok ? (long long)m * a.x_s + (long long)(kt * 4 + tt) * E + 8 * l : 0);
            cp16(d + (uint32_t)(i * 16), src, ok);
        }
    };

    constexpr int NC = RT >= 4 ? 1 : 4 / RT;
    float acc[RT][NC][4];
#pragma unroll
    for (int r = 0; r < RT; r++)
#pragma unroll
        for (int c = 0; c < NC; c++) acc[r][c][0] = acc[r][c][1] = acc[r][c][2] = acc[r][c][3] = 0.f;

    // weights of the first S - 1 stages before the wait (one group each), then their x (one group)
    if (nst) {
#pragma unroll
        for (int s = 0; s < S - 1; s++) copy_w(s), cp_commit();
    }
    rwkv_pdl::pdl_wait();
    rwkv_pdl::pdl_trigger();
    if (nst) {
#pragma unroll
        for (int s = 0; s < S - 1; s++)
            if (s < nst) copy_x(s);
        cp_commit();
        cp_wait<0>();
    }
    __syncwarp();
    const int mg = g < M ? g : 0;
    for (int s = 0; s < nst; s++) {
        if (s) {
            cp_wait<S - 2>();  // stage s's group (stages < S - 1 completed above)
            __syncwarp();      // x pieces of other lanes; every lane is done with slot (s - 1) % S
        }
        if (s + S - 1 < nst) copy_w(s + S - 1), copy_x(s + S - 1);
        cp_commit();  // possibly empty: one group per iteration keeps the count uniform
        const uint32_t d = base + (uint32_t)((s % S) * stage);
#pragma unroll
        for (int u = 0; u < U; u++) {
            uint4 xq[XL];
#pragma unroll
            for (int l = 0; l < XL; l++) {
                xq[l] = lds16(d + (uint32_t)(WBY + (((u * XL + l) * M + mg) * 4 + t) * 16));
                if constexpr (RELU2) xq[l] = relu2_8<F>(xq[l]);
            }
#pragma unroll
            for (int r = 0; r < RT; r++) {
                const uint4 wv = lds16(d + (uint32_t)(((r * U + u) * 32 + lane) * 16));
                if constexpr (WQ == W_SAME) {
                    mma<BF>(acc[r][(2 * u) % NC], xq[0].x, xq[0].y, wv.x, wv.y);
                    mma<BF>(acc[r][(2 * u + 1) % NC], xq[0].z, xq[0].w, wv.z, wv.w);
                } else {
                    const uint32_t wc[4] = {wv.x, wv.y, wv.z, wv.w};
#pragma unroll
                    for (int q = 0; q < 4; q++) {
                        const uint2 h = codes_to_h4<WQ>(wc[q]);
                        const uint4 &xx = xq[(q >> 1) % XL];
                        mma<false>(acc[r][(4 * u + q) % NC], (q & 1) ? xx.z : xx.x, (q & 1) ? xx.w : xx.y, h.x, h.y);
                    }
                }
            }
        }
    }
    cp_wait<0>();
#pragma unroll
    for (int r = 0; r < RT; r++)
#pragma unroll
        for (int c = 1; c < NC; c++) acc[r][0][0] += acc[r][c][0], acc[r][0][1] += acc[r][c][1];
#pragma unroll
    for (int r = 0; r < RT; r++) {
        red[warp][g][r * 8 + 2 * t] = acc[r][0][0];
        red[warp][g][r * 8 + 2 * t + 1] = acc[r][0][1];
    }
    __syncthreads();
    F *out = static_cast<F *>(a.out) + (long long)blockIdx.y * a.o_ps;
    const float *scale = WQ == W_SAME ? nullptr : a.scale + (long long)blockIdx.y * a.s_ps;
    for (int i = threadIdx.x; i < M * 8 * RT; i += blockDim.x) {
        const int m = i / (8 * RT), j = i % (8 * RT);
        if (n0 + j >= a.N) continue;
        float s = 0.f;
        for (int v = 0; v < W; v++) s += red[v][m][j];
        if constexpr (WQ != W_SAME) s *= scale[n0 + j];
        out[m * a.o_s + n0 + j] = from_f<F>(s);
    }
}

}  // namespace gemv_k
