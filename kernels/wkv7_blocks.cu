// WKV-7 prefill by blocks of L tokens: the algebra of server/model/wkv_chunked.py (whose
// block_prep / block_scan are this file's pure-torch twin), in two launches.
//
//   prep_kernel  grid (nb, H, B), PREP_THREADS: every (block, head, sequence) at once. From the
//                block's r, w, k, v, a, b it writes one record of fp32 values (layout REC_*):
//                W, Q, B~ (L, N), Y_in (L, N: token, value row), E (N, N: value row, key column),
//                g_L (N) and a flag: the block's decay left the range in which 1 / g is formed
//                safely (then scan_kernel runs that block token by token from the inputs).
//   scan_kernel  grid (N / RS, H, B), SCAN_THREADS: RS rows of one head's state, block after
//                block: U = W S^T, y = Q S^T + Y_in (written out), S <- S diag(g_L) + U^T B~ + E.
//
// Only the scan is sequential, and each of its steps is a block of tokens: the token-by-token
// kernel (wkv7_chunk.cu) carries one reduction per token along the whole chunk. Everything is
// fp32 arithmetic; the state is read once and written once, as in wkv7_chunk.cu. Tokens
// t >= lengths[b] (or T) are identity steps and their y is not written.
#include <cuda_pipeline.h>

#include "wkv7_common.cuh"

#if RWKV_HEAD_SIZE == 64  // written for head size 64 (every RWKV-7 release); other builds get the stubs below
namespace wkv7 {
namespace blocks {

constexpr int L = 32;             // tokens per block (wkv_chunked.BLOCK)
constexpr int LD = N + 1;         // padded shared row of an (L, N) matrix read across rows
constexpr int LW = N + 4;         // shared row of the scan's staged W and Q (16-byte copies)
constexpr int MAX_LOG_DECAY = 60;  // wkv_chunked.MAX_LOG_DECAY
constexpr int PREP_THREADS = 256;  // L * N / 8: scale_block's segments and the Q / Y_in tiles assume it
constexpr int SEG = L * N / PREP_THREADS;  // 8 tokens: scale_block's segments
constexpr int RS = 16;            // state rows per scan block
constexpr int SCAN_THREADS = 256;

// One record per (sequence, head, block), blocks of a head consecutive.
constexpr int REC_W = 0, REC_Q = L * N, REC_BT = 2 * L * N, REC_YI = 3 * L * N, REC_E = 4 * L * N;
constexpr int REC_G = REC_E + N * N, REC_FLAG = REC_G + N;
constexpr int REC = REC_FLAG + 4;  // floats (a multiple of 4: records stay 16-byte aligned)

struct Acts {
    const void *r, *w, *k, *v, *a, *b;
    long long act_bstride, act_tstride, w_bstride, w_tstride;
    void *y;
    long long y_bstride, y_tstride;
};

struct PrepSmem {
    float r[L][LD], a[L][LD], bp[L][LD], kp[L][LD], bt[L][LD], kt[L][LD], v[L][LD], lg[L][LD];
    float m[4][L][L + 1];  // tril(A' B'^T, -1), tril(A' K'^T, -1), tril(R' B'^T), tril(R' K'^T)
    float x[L][2 * N + 1];  // the solve's [W | U_v]
    float seg[L / SEG][N];  // scale_block's segment sums
};

// Stage the block's inputs as fp32 (tokens past n_valid: r = a = v = k = b = 0, log decay 0).
template <typename F>
__device__ void load_block(PrepSmem &s, const Acts &p, long long bi, int h, int t0, int n_valid, int raw_w) {
    for (int e = threadIdx.x; e < L * N; e += PREP_THREADS) {
        const int tt = e / N, n = e % N;
        float r = 0.f, k = 0.f, v = 0.f, a = 0.f, b = 0.f, ld = 0.f;
        if (tt < n_valid) {
            const long long o = bi * p.act_bstride + (long long)(t0 + tt) * p.act_tstride + (long long)h * N + n;
            r = to_f(((const F *)p.r)[o]), k = to_f(((const F *)p.k)[o]), v = to_f(((const F *)p.v)[o]);
            a = to_f(((const F *)p.a)[o]), b = to_f(((const F *)p.b)[o]);
            const float x = to_f(((const F *)p.w)[bi * p.w_bstride + (long long)(t0 + tt) * p.w_tstride + (long long)h * N + n]);
            ld = raw_w ? -expf(x) : logf(x);
        }
        s.r[tt][n] = r, s.kp[tt][n] = k, s.v[tt][n] = v, s.a[tt][n] = a, s.bp[tt][n] = b, s.lg[tt][n] = ld;
    }
}

// Per column n: log g_t = cumulative log decay; A' = a g_{t-1}, R' = r g_t, B' = b / g_t,
// K' = k / g_t, B~ = b g_L / g_t, K~ = k g_L / g_t. Thread (segment sg of SEG tokens, column n):
// its segment's sum, then the sums of the segments before it. Returns log g_L of column n.
__device__ float scale_block(PrepSmem &s) {
    const int n = threadIdx.x % N, sg = threadIdx.x / N, t0 = sg * SEG;
    float sum = 0.f;
#pragma unroll
    for (int t = t0; t < t0 + SEG; t++) sum += s.lg[t][n];
    s.seg[sg][n] = sum;
    __syncthreads();
    float lg = 0.f, last = 0.f;
#pragma unroll
    for (int q = 0; q < L / SEG; q++) {
        lg += q < sg ? s.seg[q][n] : 0.f;
        last += s.seg[q][n];
    }
#pragma unroll
    for (int t = t0; t < t0 + SEG; t++) {
        s.a[t][n] *= expf(lg);
        lg += s.lg[t][n];
        s.r[t][n] *= expf(lg);
        const float inv = expf(-lg), tail = expf(last - lg);
        const float b = s.bp[t][n], k = s.kp[t][n];
        s.bp[t][n] = b * inv, s.kp[t][n] = k * inv, s.bt[t][n] = b * tail, s.kt[t][n] = k * tail;
    }
    return last;
}

// The four (L, L) products, each thread 2 x 2 (t, i) pairs of each, masked to their triangles.
__device__ void tri_products(PrepSmem &s) {
    const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
    float acc[4][2][2] = {};
#pragma unroll 8
    for (int n = 0; n < N; n++) {
        const float a0 = s.a[ty][n], a1 = s.a[ty + 16][n], r0 = s.r[ty][n], r1 = s.r[ty + 16][n];
        const float b0 = s.bp[tx][n], b1 = s.bp[tx + 16][n], k0 = s.kp[tx][n], k1 = s.kp[tx + 16][n];
        acc[0][0][0] += a0 * b0, acc[0][0][1] += a0 * b1, acc[0][1][0] += a1 * b0, acc[0][1][1] += a1 * b1;
        acc[1][0][0] += a0 * k0, acc[1][0][1] += a0 * k1, acc[1][1][0] += a1 * k0, acc[1][1][1] += a1 * k1;
        acc[2][0][0] += r0 * b0, acc[2][0][1] += r0 * b1, acc[2][1][0] += r1 * b0, acc[2][1][1] += r1 * b1;
        acc[3][0][0] += r0 * k0, acc[3][0][1] += r0 * k1, acc[3][1][0] += r1 * k0, acc[3][1][1] += r1 * k1;
    }
#pragma unroll
    for (int u = 0; u < 2; u++)
#pragma unroll
        for (int q = 0; q < 2; q++) {
            const int t = ty + 16 * u, i = tx + 16 * q;
            s.m[0][t][i] = i < t ? acc[0][u][q] : 0.f;
            s.m[1][t][i] = i < t ? acc[1][u][q] : 0.f;
            s.m[2][t][i] = i <= t ? acc[2][u][q] : 0.f;
            s.m[3][t][i] = i <= t ? acc[3][u][q] : 0.f;
        }
}

// (I - tril(A' B'^T, -1)) [W | U_v] = [A' | tril(A' K'^T, -1) V], by forward substitution: one
// thread per column of the 2N right-hand sides.
__device__ void solve(PrepSmem &s) {
    for (int e = threadIdx.x; e < L * N; e += PREP_THREADS) {
        const int t = e / N, c = e % N;
        float acc = 0.f;
        for (int i = 0; i < t; i++) acc += s.m[1][t][i] * s.v[i][c];
        s.x[t][c] = s.a[t][c];
        s.x[t][N + c] = acc;
    }
    __syncthreads();
    const int c = threadIdx.x;
    if (c < 2 * N) {
#pragma unroll
        for (int t = 1; t < L; t++) {
            float acc0 = s.x[t][c], acc1 = 0.f;  // two chains: half the dependent adds
#pragma unroll
            for (int i = 0; i + 1 < t; i += 2) {
                acc0 += s.m[0][t][i] * s.x[i][c];
                acc1 += s.m[0][t][i + 1] * s.x[i + 1][c];
            }
            if (t & 1) acc0 += s.m[0][t][t - 1] * s.x[t - 1][c];
            s.x[t][c] = acc0 + acc1;
        }
    }
}

template <typename F>
__global__ void __launch_bounds__(PREP_THREADS) prep_kernel(const int *__restrict__ lengths, int T, Acts p,
                                                             int raw_w, float *__restrict__ work) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    PrepSmem &s = *reinterpret_cast<PrepSmem *>(smem_raw);
    const int j = blockIdx.x, h = blockIdx.y, bi = blockIdx.z, nb = gridDim.x;
    const int nT = lengths ? min(lengths[bi], T) : T;
    const int t0 = j * L;
    if (t0 >= nT) return;  // the scan stops before this block
    float *rec = work + (((long long)bi * gridDim.y + h) * nb + j) * REC;
    load_block<F>(s, p, bi, h, t0, min(L, nT - t0), raw_w);
    __syncthreads();
    const float lg_last = scale_block(s);
    if (__syncthreads_or(!(lg_last >= -(float)MAX_LOG_DECAY))) {  // (NaN too)
        if (threadIdx.x == 0) rec[REC_FLAG] = 1.f;
        return;
    }
    if (threadIdx.x < N) rec[REC_G + threadIdx.x] = expf(lg_last);
    if (threadIdx.x == 0) rec[REC_FLAG] = 0.f;
    tri_products(s);
    __syncthreads();
    solve(s);
    __syncthreads();
    // Q = R' + tril(R' B'^T) W;  Y_in = tril(R' B'^T) U_v + tril(R' K'^T) V;  W and B~ as they are.
    // Thread (column c, tokens t = tid / N + 4 q): all i, the triangles' zeros included, so the
    // eight tokens' sums are independent chains.
    {
        constexpr int NQ = L * N / PREP_THREADS;  // 8
        const int c = threadIdx.x % N, tq = threadIdx.x / N;
        float q[NQ], yi[NQ];
#pragma unroll
        for (int u = 0; u < NQ; u++) q[u] = s.r[tq + 4 * u][c], yi[u] = 0.f;
#pragma unroll 4
        for (int i = 0; i < L; i++) {
            const float w = s.x[i][c], uv = s.x[i][N + c], v = s.v[i][c];
#pragma unroll
            for (int u = 0; u < NQ; u++) {
                const int t = tq + 4 * u;
                q[u] += s.m[2][t][i] * w;
                yi[u] += s.m[2][t][i] * uv + s.m[3][t][i] * v;
            }
        }
#pragma unroll
        for (int u = 0; u < NQ; u++) {
            const int e = (tq + 4 * u) * N + c;
            rec[REC_Q + e] = q[u], rec[REC_YI + e] = yi[u];
            rec[REC_W + e] = s.x[tq + 4 * u][c], rec[REC_BT + e] = s.bt[tq + 4 * u][c];
        }
    }
    // E = U_v^T B~ + V^T K~ (value row m1, key column m2): each thread 4 x 4
    const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
    float e[4][4] = {};
#pragma unroll 4
    for (int t = 0; t < L; t++) {
        float u[4], v[4], b[4], k[4];
#pragma unroll
        for (int q = 0; q < 4; q++) {
            u[q] = s.x[t][N + ty + 16 * q], v[q] = s.v[t][ty + 16 * q];
            b[q] = s.bt[t][tx + 16 * q], k[q] = s.kt[t][tx + 16 * q];
        }
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
            for (int q = 0; q < 4; q++) e[i][q] += u[i] * b[q] + v[i] * k[q];
    }
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int q = 0; q < 4; q++) rec[REC_E + (ty + 16 * i) * N + tx + 16 * q] = e[i][q];
}

// One staged block of records for the scan (cp.async, double-buffered).
struct Stage {
    float w[L][LW], q[L][LW], bt[L][N];
    float yi[L][RS];
    float e[RS][N];
    float g[N];
    float flag[4];
};

struct ScanSmem {
    Stage st[2];
    float s[RS][LD];      // the block's state rows, fp32
    float u[L][RS + 1];   // U = W S^T for these rows
};

__device__ __forceinline__ void stage_record(Stage &st, const float *rec, int row0) {
    for (int u = threadIdx.x; u < 3 * L * (N / 4); u += SCAN_THREADS) {  // W, Q, B~: 16-byte units
        const int which = u / (L * N / 4), o = u % (L * N / 4), t = o / (N / 4), c = 4 * (o % (N / 4));
        float *dst = which == 0 ? &st.w[t][c] : which == 1 ? &st.q[t][c] : &st.bt[t][c];
        __pipeline_memcpy_async(dst, rec + which * L * N + t * N + c, 16);
    }
    for (int u = threadIdx.x; u < L * RS / 4; u += SCAN_THREADS) {  // Y_in's columns of these rows
        const int t = u / (RS / 4), c = 4 * (u % (RS / 4));
        __pipeline_memcpy_async(&st.yi[t][c], rec + REC_YI + t * N + row0 + c, 16);
    }
    for (int u = threadIdx.x; u < RS * N / 4; u += SCAN_THREADS)  // E's rows
        __pipeline_memcpy_async(&st.e[0][0] + 4 * u, rec + REC_E + row0 * N + 4 * u, 16);
    for (int u = threadIdx.x; u < N / 4 + 1; u += SCAN_THREADS)  // g_L and the flag
        __pipeline_memcpy_async(u < N / 4 ? &st.g[4 * u] : st.flag, rec + REC_G + 4 * u, 16);
    __pipeline_commit();
}

// A block whose decay left the safe range, token by token from the inputs (as wkv7_chunk.cu):
// thread (row = tid / 16, lane) holds columns lane + 16 q of its row; rows reduce over 16 lanes.
template <typename F>
__device__ void step_block(ScanSmem &sm, const Acts &p, long long bi, int h, int row0, int t0, int nt, int raw_w) {
    const int row = threadIdx.x / 16, lane = threadIdx.x % 16;
    float s[4];
#pragma unroll
    for (int q = 0; q < 4; q++) s[q] = sm.s[row][lane + 16 * q];
    for (int tt = 0; tt < nt; tt++) {
        const long long o = bi * p.act_bstride + (long long)(t0 + tt) * p.act_tstride + (long long)h * N;
        const long long ow = bi * p.w_bstride + (long long)(t0 + tt) * p.w_tstride + (long long)h * N;
        float sa = 0.f;
#pragma unroll
        for (int q = 0; q < 4; q++) sa += s[q] * to_f(((const F *)p.a)[o + lane + 16 * q]);
#pragma unroll
        for (int m = 8; m >= 1; m >>= 1) sa += __shfl_xor_sync(0xffffffffu, sa, m, 16);
        const float vi = to_f(((const F *)p.v)[o + row0 + row]);
        float y = 0.f;
#pragma unroll
        for (int q = 0; q < 4; q++) {
            const int c = lane + 16 * q;
            const float x = to_f(((const F *)p.w)[ow + c]);
            const float d = raw_w ? expf(-expf(x)) : x;
            s[q] = s[q] * d + sa * to_f(((const F *)p.b)[o + c]) + vi * to_f(((const F *)p.k)[o + c]);
            y += s[q] * to_f(((const F *)p.r)[o + c]);
        }
#pragma unroll
        for (int m = 8; m >= 1; m >>= 1) y += __shfl_xor_sync(0xffffffffu, y, m, 16);
        if (lane == 0)
            ((F *)p.y)[bi * p.y_bstride + (long long)(t0 + tt) * p.y_tstride + (long long)h * N + row0 + row] = from_f<F>(y);
    }
#pragma unroll
    for (int q = 0; q < 4; q++) sm.s[row][lane + 16 * q] = s[q];
}

// U = W S^T and y = Q S^T + Y_in for this block's tokens: thread (t = tid / 16 and t + 16, row).
template <typename F>
__device__ void block_outputs(ScanSmem &sm, const Stage &st, const Acts &p, long long bi, int h, int row0,
                              int t0, int nt) {
    const int row = threadIdx.x % 16, t = threadIdx.x / 16;
    float u0 = 0.f, u1 = 0.f, y0 = 0.f, y1 = 0.f;
#pragma unroll 16
    for (int n = 0; n < N; n++) {
        const float s = sm.s[row][n];
        u0 += st.w[t][n] * s, u1 += st.w[t + 16][n] * s;
        y0 += st.q[t][n] * s, y1 += st.q[t + 16][n] * s;
    }
    sm.u[t][row] = u0, sm.u[t + 16][row] = u1;
    F *y = (F *)p.y + bi * p.y_bstride + (long long)h * N + row0 + row;
    if (t < nt) y[(long long)(t0 + t) * p.y_tstride] = from_f<F>(y0 + st.yi[t][row]);
    if (t + 16 < nt) y[(long long)(t0 + t + 16) * p.y_tstride] = from_f<F>(y1 + st.yi[t + 16][row]);
}

// S <- S diag(g_L) + U^T B~ + E: thread (row = tid / 16, columns lane + 16 q).
__device__ void block_state(ScanSmem &sm, const Stage &st) {
    const int row = threadIdx.x / 16, lane = threadIdx.x % 16;
    float acc[4];
#pragma unroll
    for (int q = 0; q < 4; q++) {
        const int c = lane + 16 * q;
        acc[q] = sm.s[row][c] * st.g[c] + st.e[row][c];
    }
#pragma unroll 8
    for (int t = 0; t < L; t++) {
        const float u = sm.u[t][row];
#pragma unroll
        for (int q = 0; q < 4; q++) acc[q] += u * st.bt[t][lane + 16 * q];
    }
#pragma unroll
    for (int q = 0; q < 4; q++) sm.s[row][lane + 16 * q] = acc[q];
}

template <typename F, typename S>
__global__ void __launch_bounds__(SCAN_THREADS) scan_kernel(S *__restrict__ state, long long s_bstride,
                                                             const int *__restrict__ slots,
                                                             const int *__restrict__ lengths, int T, Acts p,
                                                             int raw_w, const float *__restrict__ work, int nb) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    ScanSmem &sm = *reinterpret_cast<ScanSmem *>(smem_raw);
    const int row0 = blockIdx.x * RS, h = blockIdx.y, bi = blockIdx.z;
    const int nT = lengths ? min(lengths[bi], T) : T;
    if (nT <= 0) return;
    const long long slot = slots ? (long long)slots[bi] : (long long)bi;
    S *srows = state + slot * s_bstride + ((long long)h * N + row0) * N;
    for (int e = threadIdx.x; e < RS * N; e += SCAN_THREADS) sm.s[e / N][e % N] = to_f(srows[e]);
    const float *recs = work + ((long long)bi * gridDim.y + h) * nb * (long long)REC;
    const int nbv = (nT + L - 1) / L;
    stage_record(sm.st[0], recs, row0);
    for (int j = 0; j < nbv; j++) {
        if (j + 1 < nbv) stage_record(sm.st[(j + 1) & 1], recs + (long long)(j + 1) * REC, row0);
        else __pipeline_commit();
        __pipeline_wait_prior(1);
        __syncthreads();  // stage j landed; the state rows of block j - 1 are complete
        const Stage &st = sm.st[j & 1];
        const int t0 = j * L, nt = min(L, nT - t0);
        if (st.flag[0] != 0.f) {
            step_block<F>(sm, p, bi, h, row0, t0, nt, raw_w);
        } else {
            block_outputs<F>(sm, st, p, bi, h, row0, t0, nt);
            __syncthreads();  // U complete
            block_state(sm, st);
        }
        __syncthreads();  // every read of stage j is done before iteration j + 1 refills it
    }
    for (int e = threadIdx.x; e < RS * N; e += SCAN_THREADS) srows[e] = from_f<S>(sm.s[e / N][e % N]);
}

// The opt-in to more than 48 KiB of shared memory for both kernels, once per device (the first
// call is eager: the model's warm-up runs before any CUDA-graph capture, as for the sampler).
template <typename F, typename S>
int prepare() {
    static bool done[64] = {};  // per device (a static of each prepare<F, S>)
    int dev = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e != cudaSuccess || done[dev & 63]) return (int)e;
    e = cudaFuncSetAttribute(prep_kernel<F>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)sizeof(PrepSmem));
    if (e == cudaSuccess)
        e = cudaFuncSetAttribute(scan_kernel<F, S>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)sizeof(ScanSmem));
    done[dev & 63] = e == cudaSuccess;
    return (int)e;
}

}  // namespace blocks
}  // namespace wkv7
#endif

// Floats of one block's record (the work buffer holds B * H * ceil(T / 32) of them), or -1 when
// the blocked kernels do not take this head size.
extern "C" int wkv7_blocks_record(int head_size) {
#if RWKV_HEAD_SIZE == 64
    return head_size == wkv7::N ? wkv7::blocks::REC : -1;
#else
    return -1;
#endif
}

// Arguments as wkv7_chunk (wkv7_chunk.cu), plus work: fp32, B * H * ceil(T / 32) records.
// Returns a cudaError_t value (0 = success), or -1 for an unsupported dtype combination.
extern "C" int wkv7_blocks(int f_dt, int s_dt, int raw_w, void *state, long long s_bstride, const int *slots,
                           const int *lengths, int B, int T, int H, const void *r, const void *w, const void *k,
                           const void *v, const void *a, const void *b, long long act_bstride,
                           long long act_tstride, long long w_bstride, long long w_tstride, void *y,
                           long long y_bstride, long long y_tstride, float *work, void *stream) {
#if RWKV_HEAD_SIZE != 64
    return -1;
#else
    using namespace wkv7::blocks;
    if (B <= 0 || T <= 0) return 0;
    const Acts p{r, w, k, v, a, b, act_bstride, act_tstride, w_bstride, w_tstride, y, y_bstride, y_tstride};
    const int nb = (T + L - 1) / L;
    const cudaStream_t s = (cudaStream_t)stream;
    return WKV7_DISPATCH(f_dt, s_dt, {
        constexpr int prep_bytes = sizeof(PrepSmem), scan_bytes = sizeof(ScanSmem);
        int e = prepare<F, S>();
        if (e != 0) return e;
        prep_kernel<F><<<dim3(nb, H, B), PREP_THREADS, prep_bytes, s>>>(lengths, T, p, raw_w, work);
        if ((e = (int)cudaGetLastError()) != 0) return e;
        scan_kernel<F, S><<<dim3(N / RS, H, B), SCAN_THREADS, scan_bytes, s>>>(
            (S *)state, s_bstride, slots, lengths, T, p, raw_w, work, nb);
        return (int)cudaGetLastError();
    });
#endif
}
