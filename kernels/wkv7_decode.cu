// WKV-7 one-token decode for a batch of slots, state updated in place (see wkv7_common.cuh).
//
// grid (N / (ROWS * RPT), H, B), block THREADS: block (g, h, b) owns rows [g*ROWS*RPT, (g+1)*ROWS*RPT)
// of head h of sequence b; each thread updates RPT rows (row slot + j*ROWS), sharing its column
// vectors. RPT = 2 for 16-bit state (32 state bytes in flight per thread, as for fp32), else 1. Activations r, w, k, v, a, b: (B, H*N) with row stride act_bstride (elements);
// state: slot slots[b] (or b) at state + slot*s_bstride, then (H, N, N) contiguous.
#include "wkv7_common.cuh"

namespace wkv7 {

template <typename S>
constexpr int decode_rpt() { return (sizeof(S) == 2 && N % (2 * ROWS) == 0) ? 2 : 1; }

template <typename F, typename S, int RPT>
__global__ void __launch_bounds__(THREADS) decode_kernel(
    S *__restrict__ state, long long s_bstride, const int *__restrict__ slots, int H,
    const F *__restrict__ r, const F *__restrict__ w, const F *__restrict__ k, const F *__restrict__ v,
    const F *__restrict__ a, const F *__restrict__ b, long long act_bstride, long long w_bstride,
    F *__restrict__ y, long long y_bstride, int raw_w) {
    const int bi = blockIdx.z, h = blockIdx.y;
    const int row0 = blockIdx.x * (ROWS * RPT) + threadIdx.x / TPR;
    const int lane = threadIdx.x % TPR;
    const long long slot = slots ? (long long)slots[bi] : (long long)bi;
    S *srow = state + slot * s_bstride + ((long long)h * N + row0) * N;
    const long long off = (long long)bi * act_bstride + (long long)h * N;

    float s[RPT][EPT], wv[EPT], kv[EPT], av[EPT], bv[EPT], rv[EPT], vi[RPT];
#pragma unroll
    for (int j = 0; j < RPT; j++) load_state<S>(srow + j * ROWS * N, lane, s[j]);
    ldg_cols<S, F>(w + (long long)bi * w_bstride + (long long)h * N, lane, wv);
    ldg_cols<S, F>(k + off, lane, kv);
    ldg_cols<S, F>(a + off, lane, av);
    ldg_cols<S, F>(b + off, lane, bv);
    ldg_cols<S, F>(r + off, lane, rv);
#pragma unroll
    for (int j = 0; j < RPT; j++) vi[j] = to_f(v[off + row0 + j * ROWS]);
    decay(wv, raw_w);

#pragma unroll
    for (int j = 0; j < RPT; j++) {
        const float yi = step(s[j], wv, kv, av, bv, rv, vi[j]);
        store_state<S>(srow + j * ROWS * N, lane, s[j]);
        if (lane == 0) y[(long long)bi * y_bstride + (long long)h * N + row0 + j * ROWS] = from_f<F>(yi);
    }
}

}  // namespace wkv7

// Returns a cudaError_t value (0 = success), or -1 for an unsupported dtype combination.
extern "C" int wkv7_decode(int f_dt, int s_dt, int raw_w, void *state, long long s_bstride,
                           const int *slots, int B, int H, const void *r, const void *w, const void *k,
                           const void *v, const void *a, const void *b, long long act_bstride,
                           long long w_bstride, void *y, long long y_bstride, void *stream) {
    if (B <= 0) return 0;
    return WKV7_DISPATCH(f_dt, s_dt, {
        constexpr int RPT = decode_rpt<S>();
        dim3 grid(N / (ROWS * RPT), H, B);
        decode_kernel<F, S, RPT><<<grid, THREADS, 0, (cudaStream_t)stream>>>(
            (S *)state, s_bstride, slots, H, (const F *)r, (const F *)w, (const F *)k, (const F *)v,
            (const F *)a, (const F *)b, act_bstride, w_bstride, (F *)y, y_bstride, raw_w);
        return (int)cudaGetLastError();
    });
}
