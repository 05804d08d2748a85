// RWKV-7 decode time-mix core in one launch (semantics: see wkv7_tmix.cuh's header).
#include "pdl.cuh"
#include "wkv7_tmix_head.cuh"

// ---- one launch: column work + WKV step + GroupNorm/bonus/gate, a head per block ----
// grid (H, B), block N*TPR/RPT threads (128 for N = 64, RPT = 4): block (h, b) owns the whole head,
// so the head's column vectors are computed once (not once per row slice) and the GroupNorm over
// its N outputs is a block reduction: no cluster, no second kernel, no fp32 intermediates.
// Thread layout as wkv7_decode: a state row is owned by TPR = 8 lanes holding EPT = 8 columns each
// in registers; row group rg = tid / TPR owns rows rg + j*RG (RG = N / RPT row groups, j < RPT).
//
// Order inside a block:
//   1. issue all RPT state-row loads (RPT*EPT values per thread: 128 B fp32, 64 B fp16 state);
//   2. while they are in flight, per-column work split over warps (loads hit L2):
//        warp 0: k', r, a = -kk, b = kk*a_gate (kk normalized in-warp), bonus = sum r k' r_k
//        warp 1: v = lerp(v, v_first, sigmoid(vz))                  (rows, one per column index)
//        warps 2..: decay exp(-exp(w)) of column c, and preload g, lnx_w, lnx_b of row c for step 4
//      -> shared memory, one __syncthreads;
//   3. RPT row steps (wkv7_common.cuh step(), rows interleaved), state stores issued at once;
//   4. GroupNorm: per-warp mean and M2 over its rows (shuffles), combined across warps (Chan)
//      after one more __syncthreads; threads of warps 2.. write out for row c.
//
// Why this shape: what limits the kernel is state bytes in flight per SM (Little's law: the HBM
// bandwidth times its latency, a few MB over the whole GPU). A thread has RPT rows in flight:
// 128 B (fp32) / 64 B (fp16) per thread; fp32 state: 94-96 registers -> 5 resident 128-thread
// blocks per SM = 80 KB in flight; 16-bit state (rows kept packed, see head_packed): 72 registers
// -> 7 blocks = 56 KB. So even if a block spends a quarter of its life after its loads (steps,
// GroupNorm, 2 barriers) the SM holds more bytes in flight than wkv7_decode's layout (32 KB). The
// per-column work of step 2 overlaps the state loads' latency (both are one memory round trip),
// and the only barriers wait for that phase and for the GroupNorm sums, never for a state load;
// the state stores are issued before the second barrier.
namespace wkv7 {

// Resident blocks per SM of the packed 16-bit head kernel with 4 rows (72 registers: see the top).
constexpr int HEAD_PACKED_MIN_BLOCKS = 7;

// 16-bit state with 8 columns per lane: rows stay packed in registers (4 words per row) until their
// step, and the column vectors are re-read from shared memory per row, so that 7 blocks (64 B of
// state in flight per thread) fit an SM instead of the 5 that rows unpacked to fp32 allow.
template <typename S>
__host__ __device__ constexpr bool head_packed() { return sizeof(S) == 2 && EPT == 8; }

template <typename S, int RPT>
__host__ __device__ constexpr int head_min_blocks() {
    return head_packed<S>() ? (RPT >= 4 ? HEAD_PACKED_MIN_BLOCKS : 4) : (RPT >= 4 ? 5 : 4);
}

template <typename F, typename S, int RPT>
__global__ void __launch_bounds__(head_threads<RPT>(), (head_min_blocks<S, RPT>()))
    tmix_head_kernel(S *__restrict__ state, long long s_bstride, TmixArgs p) {
    constexpr int T = head_threads<RPT>();
    constexpr int RG = T / TPR;          // row groups; rows of a group: rg + j*RG
    constexpr int NW = T / 32;           // warps
    __shared__ __align__(16) float sh_dec[N], sh_k[N], sh_a[N], sh_b[N], sh_r[N], sh_v[N], sh_y[N];
    __shared__ float red[1 + 2 * NW];
    const int h = blockIdx.x, bi = blockIdx.y, tid = threadIdx.x;
    const int rg = tid / TPR, lane = tid % TPR;
    const int hc = h * N;
    const long long base = (long long)bi * p.act_bstride + hc;
    S *shead = state + (long long)bi * s_bstride + (long long)h * N * N;

    // 1. the state rows first: in flight during step 2
    constexpr bool PACK = head_packed<S>();
    float s[PACK ? 1 : RPT][EPT];
    uint4 sp[PACK ? RPT : 1];
#pragma unroll
    for (int j = 0; j < RPT; j++) {
        if constexpr (PACK) sp[j] = ld_global_v4(shead + (long long)(rg + j * RG) * N + lane * EPT);
        else load_state<S>(shead + (long long)(rg + j * RG) * N, lane, s[j]);
    }
    // 2a. the head's weight vectors, before the wait too (wkv7_tmix_head.cuh, pdl.cuh)
    const bool l0 = p.layer0 != 0;
    HeadConsts w;
    w.load<F>(p, hc, tid);
    // the state rows are this layer's own (the predecessor, the r/k/v projection, never touches
    // them): their loads go out before the wait for the predecessor's activations
    rwkv_pdl::pdl_wait();
    rwkv_pdl::pdl_trigger();

    // 2b. per-column vectors of the head (one L2 round trip, overlapping the state loads)
    auto act = [&](const void *ptr) { return (const F *)ptr + base; };
    const HeadActs<F> x{act(p.r), act(p.k), act(p.v), act(p.wz), act(p.az), act(p.g), act(p.vz), act(p.v_first)};
    const float g_o = head_columns<F>(x, w, l0, tid, HeadCols{sh_dec, sh_k, sh_a, sh_b, sh_r, sh_v}, &red[0]);
    __syncthreads();

    // 3. the row steps; state stored as soon as a row is done
    float y[RPT];
    if constexpr (PACK) {
#pragma unroll
        for (int j = 0; j < RPT; j++) {
            const int row = rg + j * RG;
            float st[EPT], wv[EPT], kv[EPT], av[EPT], bv[EPT], rv[EPT];
            cvt4(make_uint2(sp[j].x, sp[j].y), (const S *)nullptr, st);
            cvt4(make_uint2(sp[j].z, sp[j].w), (const S *)nullptr, st + 4);
            load_cols<S, float>(sh_dec, lane, wv);
            load_cols<S, float>(sh_k, lane, kv);
            load_cols<S, float>(sh_a, lane, av);
            load_cols<S, float>(sh_b, lane, bv);
            load_cols<S, float>(sh_r, lane, rv);
            y[j] = step(st, wv, kv, av, bv, rv, sh_v[row]);
            store_state<S>(shead + (long long)row * N, lane, st);
        }
    } else {
        float wv[EPT], kv[EPT], av[EPT], bv[EPT], rv[EPT];
        load_cols<S, float>(sh_dec, lane, wv);
        load_cols<S, float>(sh_k, lane, kv);
        load_cols<S, float>(sh_a, lane, av);
        load_cols<S, float>(sh_b, lane, bv);
        load_cols<S, float>(sh_r, lane, rv);
#pragma unroll
        for (int j = 0; j < RPT; j++) {
            const int row = rg + j * RG;
            y[j] = step(s[j], wv, kv, av, bv, rv, sh_v[row]);
            store_state<S>(shead + (long long)row * N, lane, s[j]);
        }
    }

    // 4. GroupNorm over the head's N rows: per warp (WROWS rows) mean and M2, then combined
    head_gn_sums<RPT>(y, sh_y, red, tid);
    __syncthreads();
    head_gn_out<F, RPT>(red, sh_y, sh_v, w, p.gn_eps, g_o, (F *)p.out + (long long)bi * p.out_bstride + hc, tid);
}

template <typename F, typename S, int RPT>
int launch_head(int B, int H, S *state, long long s_bstride, const TmixArgs &p, cudaStream_t stream) {
    return (int)rwkv_pdl::launch_pdl(tmix_head_kernel<F, S, RPT>, dim3(H, B), dim3(head_threads<RPT>()), 0, stream, state,
                                     s_bstride, p);
}

}  // namespace wkv7

// Arguments: f_dt, s_dt, pipe_min_b, pipe_per_sm, then as TmixArgs. The kernel: for a 16-bit state
// from pipe_min_b rows on the pipelined one (wkv7_tmix_pipe.cu: it gains nothing with an fp32 state;
// pipe_per_sm > 0 caps its resident blocks per SM, 0 = as many as fit),
// else tmix_head_kernel with 4 state rows per thread (2 for head sizes under 64, whose 4-row
// blocks would be too small for the warp roles of wkv7_tmix_head.cuh).
// Returns a cudaError_t value (0 = success), -1 for an unsupported dtype combination, -2 for a
// shape it does not cover (head sizes over 64, B > 65535; nothing launched).
extern "C" int wkv7_tmix_fused(int f_dt, int s_dt, int pipe_min_b, int pipe_per_sm, void *state, long long s_bstride, int B, int H,
                               const void *r, const void *k, const void *v, const void *wz, const void *az,
                               const void *vz, const void *v_first, const void *g, long long act_bstride,
                               const void *k_k, const void *k_a, const void *r_k, const void *lnx_w,
                               const void *lnx_b, int layer0, float gn_eps, void *out, long long out_bstride,
                               const void *w0, const void *a0, const void *v0, void *stream) {
    if (B <= 0) return 0;
    if (B > 65535) return -2;  // grid.y
    wkv7::TmixArgs p{r, k, v, wz, az, vz, v_first, g, k_k, k_a, r_k, lnx_w, lnx_b,
                     out, w0, a0, v0, act_bstride, out_bstride, layer0, gn_eps};
    const cudaStream_t st = (cudaStream_t)stream;
    if (s_dt != wkv7::DT_F32 && B >= pipe_min_b) {
        const int rc = wkv7::tmix_pipe_launch(f_dt, s_dt, state, s_bstride, B, H, p, pipe_per_sm, st);
        if (rc != -2) return rc;  // -2: unaligned inputs, the head kernel below takes them
    }
    return WKV7_DISPATCH(f_dt, s_dt, {
        if constexpr (head_ok<4>()) return launch_head<F, S, 4>(B, H, (S *)state, s_bstride, p, st);
        else if constexpr (head_ok<2>()) return launch_head<F, S, 2>(B, H, (S *)state, s_bstride, p, st);
        else return -2;
    });
}
