// WKV-7 prefill: T tokens for each of B sequences in one launch, state updated in place
// (see wkv7_common.cuh for the step and the thread layout).
//
// grid (N / ROWS, H, B), block THREADS. The block keeps its rows of the state in registers for
// all T tokens; the per-token vectors (r, w, k, a, b for the head, v for the block's rows) are
// staged in shared memory CH tokens at a time with cp.async, double-buffered, so the sequential
// loop over tokens reads only shared memory. Only the state carries from one token to the next:
// each lane leaves its part of y_t in shared memory, and the block reduces and writes a chunk's
// y after its last token, so the token-to-token chain holds one row reduction (S a), not two
// and a global store. Activations: (B, T, H*N) with strides
// (act_bstride, act_tstride) in elements (w: its own strides; y likewise). lengths (optional):
// tokens t >= lengths[b] are skipped (state untouched by them, y not written).
#include <cuda_pipeline.h>

#include "wkv7_common.cuh"

namespace wkv7 {

// Tokens per staged chunk: 16, or 8 for fp32 activations (whose stages would otherwise pass the
// 48 KB of static shared memory a block may have).
template <typename F>
constexpr int CH = sizeof(F) == 4 ? 8 : 16;

template <typename F>
struct Stage {
    F rkab[4][CH<F>][N];  // r, k, a, b
    F w[CH<F>][N];
    F v[CH<F>][ROWS];
};

struct SeqArgs {
    const void *r, *w, *k, *v, *a, *b;
    long long act_bstride, act_tstride, w_bstride, w_tstride;
    void *y;
    long long y_bstride, y_tstride;
};

template <typename F>
__device__ __forceinline__ void stage_chunk(Stage<F> &st, const SeqArgs &p, long long bi, int h,
                                            int row0, int t0, int nt) {
    constexpr int VU = N * sizeof(F) / 16;     // 16-byte units per r/k/a/b vector
    constexpr int WU = N * sizeof(F) / 16;     // ... per w vector
    constexpr int RU = ROWS * sizeof(F) / 16;  // ... per v slice
    constexpr int PER_TOK = 4 * VU + WU + RU;
    for (int u = threadIdx.x; u < nt * PER_TOK; u += THREADS) {
        const int tt = u / PER_TOK, q = u % PER_TOK;
        const long long t = t0 + tt;
        const long long aoff = bi * p.act_bstride + t * p.act_tstride + (long long)h * N;
        const char *src;
        char *dst;
        if (q < 4 * VU) {
            const int which = q / VU, o = q % VU;
            const void *base = which == 0 ? p.r : which == 1 ? p.k : which == 2 ? p.a : p.b;
            src = (const char *)((const F *)base + aoff) + o * 16;
            dst = (char *)st.rkab[which][tt] + o * 16;
        } else if (q < 4 * VU + WU) {
            const int o = q - 4 * VU;
            src = (const char *)((const F *)p.w + bi * p.w_bstride + t * p.w_tstride + (long long)h * N) + o * 16;
            dst = (char *)st.w[tt] + o * 16;
        } else {
            const int o = q - 4 * VU - WU;
            src = (const char *)((const F *)p.v + aoff + row0) + o * 16;
            dst = (char *)st.v[tt] + o * 16;
        }
        __pipeline_memcpy_async(dst, src, 16);
    }
    __pipeline_commit();
}

template <typename F, typename S>
__global__ void __launch_bounds__(THREADS) chunk_kernel(S *__restrict__ state, long long s_bstride,
                                                        const int *__restrict__ slots,
                                                        const int *__restrict__ lengths, int T, SeqArgs p,
                                                        int raw_w) {
    __shared__ __align__(16) Stage<F> st[2];
    constexpr int CH = wkv7::CH<F>;
    __shared__ __align__(16) float dec[CH][N];          // decay factors of the current chunk
    __shared__ __align__(16) float ypart[CH][THREADS];  // each lane's part of y, by token
    const int bi = blockIdx.z, h = blockIdx.y;
    const int row0 = blockIdx.x * ROWS;
    const int lrow = threadIdx.x / TPR, lane = threadIdx.x % TPR;
    const int row = row0 + lrow;
    const long long slot = slots ? (long long)slots[bi] : (long long)bi;
    const int nT = lengths ? min(lengths[bi], T) : T;
    if (nT <= 0) return;
    S *srow = state + slot * s_bstride + ((long long)h * N + row) * N;
    F *y = (F *)p.y + (long long)bi * p.y_bstride + (long long)h * N + row0;  // the block's rows

    float s[EPT];
    load_state<S>(srow, lane, s);
    const int nchunks = (nT + CH - 1) / CH;
    stage_chunk<F>(st[0], p, bi, h, row0, 0, min(CH, nT));
    for (int c = 0; c < nchunks; c++) {
        const int t0 = c * CH, nt = min(CH, nT - t0);
        if (c + 1 < nchunks) stage_chunk<F>(st[(c + 1) & 1], p, bi, h, row0, t0 + CH, min(CH, nT - t0 - CH));
        else __pipeline_commit();
        __pipeline_wait_prior(1);
        __syncthreads();
        const Stage<F> &cur = st[c & 1];
        for (int e = threadIdx.x; e < nt * N; e += THREADS) {  // decay once per column, not per row
            const float x = to_f(cur.w[e / N][e % N]);
            dec[e / N][e % N] = raw_w ? expf(-expf(x)) : x;
        }
        __syncthreads();
        for (int tt = 0; tt < nt; tt++) {
            float wv[EPT], kv[EPT], av[EPT], bv[EPT], rv[EPT];
            load_cols<S, float>(dec[tt], lane, wv);
            load_cols<S, F>(cur.rkab[1][tt], lane, kv);
            load_cols<S, F>(cur.rkab[2][tt], lane, av);
            load_cols<S, F>(cur.rkab[3][tt], lane, bv);
            load_cols<S, F>(cur.rkab[0][tt], lane, rv);
            const float vi = to_f(cur.v[tt][lrow]);
            ypart[tt][threadIdx.x] = step_lane(s, wv, kv, av, bv, rv, vi);
        }
        __syncthreads();  // ypart complete; the stage just read is refilled next iteration
        for (int q = threadIdx.x; q < nt * ROWS; q += THREADS) {  // (token, row) pairs
            const int tt = q / ROWS, r = q % ROWS;
            const float *yp = ypart[tt] + r * TPR;
            y[(long long)(t0 + tt) * p.y_tstride + r] = from_f<F>(row_sum_of(yp));
        }
    }
    store_state<S>(srow, lane, s);
}

}  // namespace wkv7

// Returns a cudaError_t value (0 = success), or -1 for an unsupported dtype combination.
extern "C" int wkv7_chunk(int f_dt, int s_dt, int raw_w, void *state, long long s_bstride,
                          const int *slots, const int *lengths, int B, int T, int H, const void *r,
                          const void *w, const void *k, const void *v, const void *a, const void *b,
                          long long act_bstride, long long act_tstride, long long w_bstride,
                          long long w_tstride, void *y, long long y_bstride, long long y_tstride,
                          void *stream) {
    if (B <= 0 || T <= 0) return 0;
    wkv7::SeqArgs p{r, w, k, v, a, b, act_bstride, act_tstride, w_bstride, w_tstride, y, y_bstride, y_tstride};
    return WKV7_DISPATCH(f_dt, s_dt, {
        dim3 grid(N / ROWS, H, B);
        chunk_kernel<F, S><<<grid, THREADS, 0, (cudaStream_t)stream>>>(
            (S *)state, s_bstride, slots, lengths, T, p, raw_w);
        return (int)cudaGetLastError();
    });
}
