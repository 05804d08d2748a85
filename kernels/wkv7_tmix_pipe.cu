// RWKV-7 decode time-mix core, pipelined: persistent blocks that bulk-copy (TMA) the next heads'
// state and activations into shared memory while they compute the current head.
// Semantics: see wkv7_tmix.cu's header; same arithmetic as tmix_head_kernel (wkv7_tmix_fused.cu).
//
// Why: tmix_head_kernel keeps its state rows in registers, so a block's bytes in flight end with
// its loads, and each block then spends most of its life (column work, steps, GroupNorm, two
// barriers) with nothing in flight. Measured on the H200 at B=1024: 2.76 TB/s with an fp16 state
// (7 blocks per SM x 8 KB) and 3.61 with fp32, of ~4.2 TB/s copy bandwidth; per head both take
// ~5.5 us, i.e. latency, not bytes, sets the rate. (This kernel: 3.39 TB/s with an fp16 state;
// with fp32 no gain, so that keeps the head kernel. docs/performance-history.md, change 28.)
// Here grid (H, K): block (h, j) owns heads (b, h) for b = j, j + K, ... Its STAGES shared-memory
// slots each hold one head's state (N x N, as stored) and its 8 activation vectors; thread 0 keeps
// STAGES heads' copies in flight (cp.async.bulk, one mbarrier per slot) and refills a slot as soon
// as the block has read it. So the state stream never drains while the block computes, and the
// head's per-head weight vectors are loaded once per block, not once per head.
//
// Per head n (thread layout and phases as tmix_head_kernel's, from wkv7_tmix_head.cuh; RPT = 4 rows
// per thread, 128 threads):
//   3. row steps (state rows from the slot, new rows stored to global), 4a. GroupNorm sums;
//   then head n + 1's column work (2.: wait for its slot, then head_columns, or mma_columns with
//   the tensor-core rows of wkv7_tmix_mma.cuh) -> ONE barrier
//   (head n's slot is free: refill it) -> 4b. head n's output.
// The small per-head vectors (hb: PlainCols, or MmaCols for the tensor-core rows) are
// triple-buffered by head (n % 3) so that head n + 1's column work never overwrites what head n's
// rows or output still read.
// Measured (H200, one layer of the 2.9B shape, fp16 state, B=1024): 0.1996 ms with two barriers
// per head, 0.1980 with one; the head kernel 0.2363; tensor-core rows (MMA) 0.1964-0.1990 against
// 0.2021-0.2024 for these rows in the same call. What is left is the memory system: ncu shows 69%
// of the DRAM peak, and cutting the barrier stalls 3x (one column per thread) changed nothing.
#include <type_traits>

#include "pdl.cuh"
#include "wkv7_tmix_head.cuh"
#include "wkv7_tmix_mma.cuh"

namespace wkv7 {
namespace pipe {

constexpr int RPT = 4;
constexpr int T = N * TPR / RPT;       // 128 threads
[[maybe_unused]] constexpr int RG = T / TPR;  // row groups; rows of a group: rg + j*RG
[[maybe_unused]] constexpr int NW = T / 32;
constexpr int NV = 8;                  // activation vectors per head: r k v wz az g [vz v_first]
static_assert(T == head_threads<RPT>(), "the head kernel's thread layout");

// 4 resident blocks per SM: the column vectors stay in registers for the head's 4 rows (~110 of
// them). Measured at B=1024, fp16 state (bench_kernels --tmix): 3.36 TB/s; re-reading the columns
// from shared memory per row (80 registers, 6 blocks) 3.24; the same at 5 blocks (spills) 3.20.
constexpr int MIN_BLOCKS = 4;
// The tensor-core rows need no column registers: 74-76 registers, 6 blocks per SM.
constexpr int MMA_MIN_BLOCKS = 6;

// The per-head vectors of the CUDA-core row phase (shared memory, triple-buffered by head).
struct alignas(16) PlainCols {
    float dec[N], k[N], a[N], b[N], r[N], v[N], y[N];
    float red[1 + 2 * NW];
};

// MMA: the tensor-core row phase (wkv7_tmix_mma.cuh; fp16 state, N = 64 only)
template <typename S, bool MMA>
__host__ __device__ constexpr bool mma_ok() { return !MMA || (sizeof(S) == 2 && N == MN); }

__device__ __forceinline__ uint32_t saddr(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void mbar_init(uint64_t *bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(saddr(bar)), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_expect_tx(uint64_t *bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(saddr(bar)), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_wait(uint64_t *bar, uint32_t parity) {
    asm volatile(
        "{\n"
        ".reg .pred P1;\n"
        "WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n"
        "@P1 bra DONE;\n"
        "bra WAIT;\n"
        "DONE:\n"
        "}\n" ::"r"(saddr(bar)),
        "r"(parity)
        : "memory");
}

// bytes (a multiple of 16, both addresses 16-byte aligned) global -> shared, completing on bar
__device__ __forceinline__ void bulk_load(void *dst, const void *src, uint32_t bytes, uint64_t *bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     saddr(dst)),
                 "l"(src), "r"(bytes), "r"(saddr(bar))
                 : "memory");
}

template <typename F, typename S>
struct Slot {
    static constexpr uint32_t SB = N * N * sizeof(S);  // state bytes
    static constexpr uint32_t VB = N * sizeof(F);      // one activation vector's bytes
    static constexpr uint32_t BYTES = (SB + NV * VB + 127) / 128 * 128;
};

template <typename F, typename S, int STAGES, bool MMA>
__global__ void __launch_bounds__(T, MMA ? MMA_MIN_BLOCKS : MIN_BLOCKS)
    tmix_pipe_kernel(S *__restrict__ state, long long s_bstride, TmixArgs p, int B) {
    static_assert(mma_ok<S, MMA>(), "the MMA row phase is for an fp16 state with head size 64");
    using SL = Slot<F, S>;
    using HB = std::conditional_t<MMA, MmaCols, PlainCols>;
    extern __shared__ __align__(128) unsigned char dyn[];
    __shared__ __align__(16) HB hb[3];  // head n's vectors in hb[n % 3]
    __shared__ __align__(8) uint64_t bars[STAGES];
    const int h = blockIdx.x, j0 = blockIdx.y, K = gridDim.y, tid = threadIdx.x;
    const int rg = tid / TPR, lane = tid % TPR;
    const int hc = h * N;
    const int items = j0 < B ? (B - 1 - j0) / K + 1 : 0;
    const bool l0 = p.layer0 != 0;
    const int nv = l0 ? 6 : 8;  // layer 0 reads no vz, v_first
    const void *acts[NV] = {p.r, p.k, p.v, p.wz, p.az, p.g, p.vz, p.v_first};
    auto act = [&](int s, int v) { return (const F *)(dyn + s * SL::BYTES + SL::SB + v * SL::VB); };
    auto seq = [&](int n) { return (long long)j0 + (long long)n * K; };

    // thread 0: the state of head n into slot n % STAGES (allowed before the PDL wait: only this
    // kernel touches this layer's state), then, after the wait, its activations on the same mbarrier
    auto issue_state = [&](int n) {
        const int s = n % STAGES;
        mbar_expect_tx(&bars[s], SL::SB + nv * SL::VB);
        bulk_load(dyn + s * SL::BYTES, state + seq(n) * s_bstride + (long long)h * N * N, SL::SB, &bars[s]);
    };
    auto issue_acts = [&](int n) {
        const int s = n % STAGES;
        const long long off = seq(n) * p.act_bstride + hc;
#pragma unroll
        for (int v = 0; v < NV; v++)
            if (v < nv) bulk_load(dyn + s * SL::BYTES + SL::SB + v * SL::VB, (const F *)acts[v] + off, SL::VB, &bars[s]);
    };

    if (tid == 0) {
#pragma unroll
        for (int s = 0; s < STAGES; s++) mbar_init(&bars[s], 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (tid == 0)
        for (int n = 0; n < STAGES && n < items; n++) issue_state(n);

    // per-head weight vectors (this block's head only): once per block
    std::conditional_t<MMA, MmaConsts, HeadConsts> w;
    if (p.early) w.template load<F>(p, hc, tid);
    rwkv_pdl::pdl_wait();
    rwkv_pdl::pdl_trigger();
    if (!p.early) w.template load<F>(p, hc, tid);
    if (tid == 0)
        for (int n = 0; n < STAGES && n < items; n++) issue_acts(n);

    // 2. per-column vectors of head n, from its slot, into buffer n % 3 (returns this thread's gate)
    auto columns = [&](int n) {
        const int s = n % STAGES, d = n % 3;
        mbar_wait(&bars[s], (n / STAGES) & 1);
        const HeadActs<F> x{act(s, 0), act(s, 1), act(s, 2), act(s, 3), act(s, 4), act(s, 5), act(s, 6), act(s, 7)};
        HB &c = hb[d];
        if constexpr (MMA) return mma_columns<F>(x, w, l0, tid, c);
        else return head_columns<F>(x, w, l0, tid, HeadCols{c.dec, c.k, c.a, c.b, c.r, c.v}, &c.red[0]);
    };
    // 3. the row steps of head n: rows from its slot, new rows straight to the pool; 4a. the
    // GroupNorm sums over the head's N rows: per warp (WROWS rows) mean and M2
    auto rows = [&](int n) {
        HB &c = hb[n % 3];
        const S *sst = (const S *)(dyn + (n % STAGES) * SL::BYTES);
        S *shead = state + seq(n) * s_bstride + (long long)h * N * N;
        if constexpr (MMA) {
            mma_rows(sst, shead, c, tid);
        } else {
            float y[RPT], wv[EPT], kv[EPT], av[EPT], bv[EPT], rv[EPT];  // a thread's columns: the same in its rows
            load_cols<S, float>(c.dec, lane, wv);
            load_cols<S, float>(c.k, lane, kv);
            load_cols<S, float>(c.a, lane, av);
            load_cols<S, float>(c.b, lane, bv);
            load_cols<S, float>(c.r, lane, rv);
#pragma unroll
            for (int j = 0; j < RPT; j++) {
                const int row = rg + j * RG;
                float st[EPT];
                if constexpr (sizeof(S) == 2 && EPT == 8) {
                    const uint4 x = *reinterpret_cast<const uint4 *>(sst + row * N + lane * EPT);
                    cvt4(make_uint2(x.x, x.y), (const S *)nullptr, st);
                    cvt4(make_uint2(x.z, x.w), (const S *)nullptr, st + 4);
                } else {
                    load_cols<S, S>(sst + row * N, lane, st);
                }
                y[j] = step(st, wv, kv, av, bv, rv, c.v[row]);
                store_state<S>(shead + (long long)row * N, lane, st);
            }
            head_gn_sums<RPT>(y, c.y, c.red, tid);
        }
    };
    // 4b. head n's output
    auto output = [&](int n, float g_o) {
        const HB &c = hb[n % 3];
        head_gn_out<F, RPT>(c.red, c.y, c.v, w, p.gn_eps, g_o, (F *)p.out + seq(n) * p.out_bstride + hc, tid);
    };

    // One barrier per head: head n + 1's column work goes before the barrier that ends head n.
    // Buffer n % 3: head n + 1's columns overwrite head n - 2's, whose output every thread wrote
    // before the barrier of head n - 1, which this thread has passed.
    float g_next = 0.f;
    if (items > 0) g_next = columns(0);
    __syncthreads();
    for (int n = 0; n < items; n++) {
        const float g_o = g_next;
        rows(n);
        if (n + 1 < items) g_next = columns(n + 1);
        __syncthreads();
        // every thread is past its reads of head n's slot: refill it with head n + STAGES
        if (tid == 0 && n + STAGES < items) {
            issue_state(n + STAGES);
            issue_acts(n + STAGES);
        }
        output(n, g_o);
    }
}

inline int num_sms() {
    static int sms[64] = {};
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) return 0;
    int &n = sms[dev & 63];
    if (n == 0 && cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) n = 0;
    return n;
}

// Blocks per head K: at most one full wave (occupancy x SMs), then as few as give every block the
// same number of heads (ceil(B / K) each).
template <typename F, typename S, int STAGES, bool MMA>
int launch(int B, int H, S *state, long long s_bstride, const TmixArgs &p, cudaStream_t stream) {
    if constexpr (!head_ok<RPT>() || !mma_ok<S, MMA>()) {  // the warp roles need 2 warps + N threads (head sizes <= 64)
        return -2;
    } else {
        constexpr int smem = STAGES * Slot<F, S>::BYTES;
        static int per_sm = 0;  // per instantiation (one device per process in the server)
        if (per_sm == 0) {
            cudaError_t e = cudaFuncSetAttribute(tmix_pipe_kernel<F, S, STAGES, MMA>,
                                                 cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
            if (e == cudaSuccess)
                e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, tmix_pipe_kernel<F, S, STAGES, MMA>, T, smem);
            if (e != cudaSuccess) return (int)e;
            if (per_sm <= 0) return -2;
        }
        const int slots = per_sm * num_sms();
        int K = slots / H;  // rounded down: one block over a full wave would double the kernel's tail
        K = K < 1 ? 1 : (K > B ? B : K);
        const int per_block = (B + K - 1) / K;
        K = (B + per_block - 1) / per_block;
        if (K > 65535) return -2;
        return (int)rwkv_pdl::launch_pdl(tmix_pipe_kernel<F, S, STAGES, MMA>, dim3(H, K), dim3(T), smem, stream, state,
                                         s_bstride, p, B);
    }
}

}  // namespace pipe

// 16-byte alignment of every bulk copy's source (state rows per head, activation vectors per head)
static bool pipe_aligned(const void *state, long long s_bytes, const TmixArgs &p, long long a_bytes) {
    auto al = [](const void *q) { return ((uintptr_t)q & 15) == 0; };
    if (!al(state) || (s_bytes & 15) || (a_bytes & 15)) return false;
    const void *acts[8] = {p.r, p.k, p.v, p.wz, p.az, p.g, p.vz, p.v_first};
    for (int i = 0; i < (p.layer0 ? 6 : 8); i++)
        if (!acts[i] || !al(acts[i])) return false;
    return true;
}

// stages: 2 or 3 slots per block; mma: the tensor-core row phase where it applies (fp16 state,
// N = 64), else the CUDA-core one. -2 when the pipelined kernel does not apply (the caller
// takes tmix_head_kernel).
int tmix_pipe_launch(int f_dt, int s_dt, int stages, bool mma, void *state, long long s_bstride, int B, int H,
                     const TmixArgs &p, cudaStream_t stream) {
    return WKV7_DISPATCH(f_dt, s_dt, {
        if (!pipe_aligned(state, s_bstride * (long long)sizeof(S), p, p.act_bstride * (long long)sizeof(F)))
            return -2;
        if constexpr (pipe::mma_ok<S, true>()) {
            if (mma) {  // the bulk copies already need sm_90; the MMAs sm_80
                if (stages == 3) return pipe::launch<F, S, 3, true>(B, H, (S *)state, s_bstride, p, stream);
                return pipe::launch<F, S, 2, true>(B, H, (S *)state, s_bstride, p, stream);
            }
        }
        if (stages == 3) return pipe::launch<F, S, 3, false>(B, H, (S *)state, s_bstride, p, stream);
        return pipe::launch<F, S, 2, false>(B, H, (S *)state, s_bstride, p, stream);
    });
}

}  // namespace wkv7
