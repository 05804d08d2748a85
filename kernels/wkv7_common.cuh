// Shared pieces of the WKV-7 kernels (decode and chunked prefill).
//
// RWKV-7 step for one head (N = head size, state S[i, j]: i = value row, j = key column):
//     sa_i  = sum_j S[i, j] a[j]
//     S[i, j] = S[i, j] w[j] + sa_i b[j] + v[i] k[j]
//     y_i   = sum_j S[i, j] r[j]
// Rows are independent, so a row is owned by TPR consecutive lanes of one warp, each holding
// EPT = N / TPR state values in registers (fp32), reduced with warp shuffles. The state is read
// once at the start of a launch and written once at the end (in place, fp32 or fp16 storage).
//
// Column map of a thread's EPT values: EPT/4 groups of 4 consecutive columns.
//   fp32 storage: group g starts at g*4*TPR + lane*4 (a warp's 16-byte accesses cover whole rows)
//   16-bit storage: group g starts at lane*EPT + g*4 (one 16-byte access per thread for N = 64)
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#ifndef RWKV_HEAD_SIZE
#define RWKV_HEAD_SIZE 64
#endif

namespace wkv7 {

// Multiprocessors of the current device (host side; cached per device, 0 when the query fails).
inline int num_sms() {
    static int sms[64] = {};
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) return 0;
    int &n = sms[dev & 63];
    if (n == 0 && cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) n = 0;
    return n;
}

constexpr int N = RWKV_HEAD_SIZE;
constexpr int TPR = 8;                // threads per state row
constexpr int EPT = N / TPR;          // state values per thread
constexpr int NG = EPT / 4;           // groups of 4 columns per thread
constexpr int ROWS = 16;              // rows per block
constexpr int THREADS = ROWS * TPR;   // 128
static_assert(N % 32 == 0, "head size must be a multiple of 32");

// dtype codes shared with the Python loader
enum Dtype { DT_F32 = 0, DT_F16 = 1, DT_BF16 = 2 };

template <typename S>
__device__ __forceinline__ int group_col(int g, int lane) {
    if constexpr (sizeof(S) == 4) return g * 4 * TPR + lane * 4;
    else return lane * EPT + g * 4;
}

__device__ __forceinline__ void cvt4(const float4 &x, float *o) { o[0] = x.x; o[1] = x.y; o[2] = x.z; o[3] = x.w; }
__device__ __forceinline__ void cvt4(const uint2 &x, const __half *, float *o) {
    float2 lo = __half22float2(*reinterpret_cast<const __half2 *>(&x.x));
    float2 hi = __half22float2(*reinterpret_cast<const __half2 *>(&x.y));
    o[0] = lo.x; o[1] = lo.y; o[2] = hi.x; o[3] = hi.y;
}
__device__ __forceinline__ void cvt4(const uint2 &x, const __nv_bfloat16 *, float *o) {
    float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(&x.x));
    float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(&x.y));
    o[0] = lo.x; o[1] = lo.y; o[2] = hi.x; o[3] = hi.y;
}

// Load 4 consecutive values (16-byte aligned for fp32, 8-byte for 16-bit) as fp32.
template <typename T>
__device__ __forceinline__ void load4(const T *p, float *o) {
    if constexpr (sizeof(T) == 4) cvt4(*reinterpret_cast<const float4 *>(p), o);
    else cvt4(*reinterpret_cast<const uint2 *>(p), (const T *)nullptr, o);
}

// As load4, from global memory through the read-only path with one 16-/8-byte load (nvcc splits
// some plain float4 loads into 4 + 2 + 1 + 1 ... pieces).
template <typename T>
__device__ __forceinline__ void ldg4(const T *p, float *o) {
    if constexpr (sizeof(T) == 4) cvt4(__ldg(reinterpret_cast<const float4 *>(p)), o);
    else cvt4(__ldg(reinterpret_cast<const uint2 *>(p)), (const T *)nullptr, o);
}

// As load_cols, for a global vector that no thread writes during the kernel.
template <typename S, typename T>
__device__ __forceinline__ void ldg_cols(const T *vec, int lane, float *o) {
#pragma unroll
    for (int g = 0; g < NG; g++) ldg4<T>(vec + group_col<S>(g, lane), o + 4 * g);
}

// Load this thread's EPT columns of a length-N vector (columns laid out as for storage S).
template <typename S, typename T>
__device__ __forceinline__ void load_cols(const T *vec, int lane, float *o) {
#pragma unroll
    for (int g = 0; g < NG; g++) load4<T>(vec + group_col<S>(g, lane), o + 4 * g);
}

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// x rounded to F and back: torch's rounding of an intermediate it stores in dtype F.
template <typename F>
__device__ __forceinline__ float rnd(float x) { return to_f(from_f<F>(x)); }

// Store 4 consecutive values (16-byte aligned for fp32, 8-byte for 16-bit) rounded to F.
template <typename F>
__device__ __forceinline__ void store4(F *p, const float *v) {
    if constexpr (sizeof(F) == 4) {
        *reinterpret_cast<float4 *>(p) = make_float4(v[0], v[1], v[2], v[3]);
    } else {
        F q[4] = {from_f<F>(v[0]), from_f<F>(v[1]), from_f<F>(v[2]), from_f<F>(v[3])};
        *reinterpret_cast<uint2 *>(p) = *reinterpret_cast<uint2 *>(q);
    }
}

// Two floats -> one 32-bit word of two 16-bit values (round to nearest), low half first.
template <typename T> __device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <> __device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t *>(&h);
}
template <> __device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t *>(&h);
}

// One 16-byte global store (inline PTX: nvcc otherwise splits some uint4 stores into 4 x 32-bit).
__device__ __forceinline__ void st_global_v4(void *p, uint4 v) {
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
}

__device__ __forceinline__ uint4 ld_global_v4(const void *p) {
    uint4 v;
    asm volatile("ld.global.v4.b32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// State row slice <-> registers (explicit 16-byte accesses: the state is the bandwidth).
template <typename S>
__device__ __forceinline__ void load_state(const S *row, int lane, float *s) {
    if constexpr (sizeof(S) == 2 && EPT == 8) {
        const uint4 x = ld_global_v4(row + lane * EPT);
        cvt4(make_uint2(x.x, x.y), (const S *)nullptr, s);
        cvt4(make_uint2(x.z, x.w), (const S *)nullptr, s + 4);
    } else if constexpr (sizeof(S) == 4) {
#pragma unroll
        for (int g = 0; g < NG; g++) {
            const uint4 x = ld_global_v4(row + group_col<S>(g, lane));
            s[4 * g] = __uint_as_float(x.x), s[4 * g + 1] = __uint_as_float(x.y);
            s[4 * g + 2] = __uint_as_float(x.z), s[4 * g + 3] = __uint_as_float(x.w);
        }
    } else {
        load_cols<S, S>(row, lane, s);
    }
}

template <typename S>
__device__ __forceinline__ void store_state(S *row, int lane, const float *s) {
    if constexpr (sizeof(S) == 2 && EPT == 8) {  // one 16-byte store, as load_state
        st_global_v4(row + lane * EPT, make_uint4(pack2<S>(s[0], s[1]), pack2<S>(s[2], s[3]),
                                                  pack2<S>(s[4], s[5]), pack2<S>(s[6], s[7])));
    } else {
#pragma unroll
        for (int g = 0; g < NG; g++) {
            S *p = row + group_col<S>(g, lane);
            if constexpr (sizeof(S) == 4) {
                st_global_v4(p, make_uint4(__float_as_uint(s[4 * g]), __float_as_uint(s[4 * g + 1]),
                                           __float_as_uint(s[4 * g + 2]), __float_as_uint(s[4 * g + 3])));
            } else {
                S q[4] = {from_f<S>(s[4 * g]), from_f<S>(s[4 * g + 1]), from_f<S>(s[4 * g + 2]), from_f<S>(s[4 * g + 3])};
                *reinterpret_cast<uint2 *>(p) = *reinterpret_cast<uint2 *>(q);
            }
        }
    }
}

// Sum over the TPR lanes that own one row (consecutive lanes, TPR a power of two).
__device__ __forceinline__ float row_sum(float x) {
#pragma unroll
    for (int o = TPR / 2; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

// row_sum's result from the TPR lanes' values in memory, added in row_sum's order (so the same
// bits as row_sum in any lane).
__device__ __forceinline__ float row_sum_of(const float *x) {
    static_assert(TPR == 8, "row_sum_of follows row_sum's butterfly for 8 lanes");
    return ((x[0] + x[4]) + (x[2] + x[6])) + ((x[1] + x[5]) + (x[3] + x[7]));
}

// One token: update the thread's EPT state values, return this lane's part of the row's y (the
// row's y is row_sum of it; a caller that does not need y at once reduces it later, off the
// token-to-token chain). w holds the decay factor (already exp(-exp(.))-ed).
__device__ __forceinline__ float step_lane(float *s, const float *w, const float *k, const float *a,
                                           const float *b, const float *r, float v) {
    float sa0 = 0.f, sa1 = 0.f;  // two chains: half the dependent FMA latency
#pragma unroll
    for (int e = 0; e < EPT; e += 2) sa0 = fmaf(s[e], a[e], sa0), sa1 = fmaf(s[e + 1], a[e + 1], sa1);
    const float sa = row_sum(sa0 + sa1);
    float y0 = 0.f, y1 = 0.f;
#pragma unroll
    for (int e = 0; e < EPT; e += 2) {
        s[e] = fmaf(s[e], w[e], fmaf(sa, b[e], v * k[e]));
        s[e + 1] = fmaf(s[e + 1], w[e + 1], fmaf(sa, b[e + 1], v * k[e + 1]));
        y0 = fmaf(s[e], r[e], y0), y1 = fmaf(s[e + 1], r[e + 1], y1);
    }
    return y0 + y1;
}

// One token as step_lane, returning the row's y (the same in all TPR lanes).
__device__ __forceinline__ float step(float *s, const float *w, const float *k, const float *a,
                                      const float *b, const float *r, float v) {
    return row_sum(step_lane(s, w, k, a, b, r, v));
}

// Decay: raw_w != 0 means w is log(-log(decay)) as in the `rwkv` package's CUDA path.
__device__ __forceinline__ void decay(float *w, int raw_w) {
    if (raw_w) {
#pragma unroll
        for (int e = 0; e < EPT; e++) w[e] = expf(-expf(w[e]));
    }
}

}  // namespace wkv7

// Dispatch helper: runs the body with F (activation type, also w's) and S (state type).
#define WKV7_DISPATCH(f_dt, s_dt, ...)                                          \
    [&]() -> int {                                                              \
        using namespace wkv7;                                                   \
        if (f_dt == DT_F16) {                                                   \
            using F = __half;                                                   \
            if (s_dt == DT_F32) { using S = float; __VA_ARGS__ }                \
            if (s_dt == DT_F16) { using S = __half; __VA_ARGS__ }               \
        } else if (f_dt == DT_BF16) {                                           \
            using F = __nv_bfloat16;                                            \
            if (s_dt == DT_F32) { using S = float; __VA_ARGS__ }                \
            if (s_dt == DT_F16) { using S = __half; __VA_ARGS__ }               \
        } else if (f_dt == DT_F32) {                                            \
            using F = float;                                                    \
            if (s_dt == DT_F32) { using S = float; __VA_ARGS__ }                \
            if (s_dt == DT_F16) { using S = __half; __VA_ARGS__ }               \
        }                                                                       \
        return -1; /* unsupported dtype combination */                          \
    }()

// Dispatch helper for kernels without a state: runs the body with F (the activation type).
#define WKV7_F_DISPATCH(f_dt, ...)                                              \
    [&]() -> int {                                                              \
        using namespace wkv7;                                                   \
        if (f_dt == DT_F16) { using F = __half; __VA_ARGS__ }                   \
        if (f_dt == DT_BF16) { using F = __nv_bfloat16; __VA_ARGS__ }           \
        if (f_dt == DT_F32) { using F = float; __VA_ARGS__ }                    \
        return -1;                                                              \
    }()
