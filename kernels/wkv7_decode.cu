// WKV-7 one-token decode for a batch of slots, state updated in place (see wkv7_common.cuh).
//
// grid (N / ROWS, H, B), block THREADS: block (g, h, b) owns rows [g*ROWS, (g+1)*ROWS) of head h
// of sequence b. Activations r, w, k, v, a, b: (B, H*N) with row stride act_bstride (elements);
// state: slot slots[b] (or b) at state + slot*s_bstride, then (H, N, N) contiguous.
#include "wkv7_common.cuh"

namespace wkv7 {

template <typename F, typename S>
__global__ void __launch_bounds__(THREADS) decode_kernel(
    S *__restrict__ state, long long s_bstride, const int *__restrict__ slots, int H,
    const F *__restrict__ r, const F *__restrict__ w, const F *__restrict__ k, const F *__restrict__ v,
    const F *__restrict__ a, const F *__restrict__ b, long long act_bstride, long long w_bstride,
    F *__restrict__ y, long long y_bstride, int raw_w) {
    const int bi = blockIdx.z, h = blockIdx.y;
    const int row = blockIdx.x * ROWS + threadIdx.x / TPR;
    const int lane = threadIdx.x % TPR;
    const long long slot = slots ? (long long)slots[bi] : (long long)bi;
    S *srow = state + slot * s_bstride + ((long long)h * N + row) * N;
    const long long off = (long long)bi * act_bstride + (long long)h * N;

    float s[EPT], wv[EPT], kv[EPT], av[EPT], bv[EPT], rv[EPT];
    load_state<S>(srow, lane, s);
    load_cols<S, F>(w + (long long)bi * w_bstride + (long long)h * N, lane, wv);
    load_cols<S, F>(k + off, lane, kv);
    load_cols<S, F>(a + off, lane, av);
    load_cols<S, F>(b + off, lane, bv);
    load_cols<S, F>(r + off, lane, rv);
    const float vi = to_f(v[off + row]);
    decay(wv, raw_w);

    const float yi = step(s, wv, kv, av, bv, rv, vi);
    store_state<S>(srow, lane, s);
    if (lane == 0) y[(long long)bi * y_bstride + (long long)h * N + row] = from_f<F>(yi);
}

}  // namespace wkv7

// Returns a cudaError_t value (0 = success), or -1 for an unsupported dtype combination.
extern "C" int wkv7_decode(int f_dt, int s_dt, int raw_w, void *state, long long s_bstride,
                           const int *slots, int B, int H, const void *r, const void *w, const void *k,
                           const void *v, const void *a, const void *b, long long act_bstride,
                           long long w_bstride, void *y, long long y_bstride, void *stream) {
    if (B <= 0) return 0;
    return WKV7_DISPATCH(f_dt, s_dt, {
        dim3 grid(N / ROWS, H, B);
        decode_kernel<F, S><<<grid, THREADS, 0, (cudaStream_t)stream>>>(
            (S *)state, s_bstride, slots, H, (const F *)r, (const F *)w, (const F *)k, (const F *)v,
            (const F *)a, (const F *)b, act_bstride, w_bstride, (F *)y, y_bstride, raw_w);
        return (int)cudaGetLastError();
    });
}
