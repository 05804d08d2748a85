// RWKV-7 decode time-mix core for a 16-bit state, pipelined: persistent blocks that bulk-copy (TMA)
// the next heads' state and activations into shared memory while they compute the current head.
// Semantics: see wkv7_tmix.cuh's header; same arithmetic as tmix_head_kernel (wkv7_tmix_fused.cu),
// with the row steps on the tensor cores (wkv7_tmix_mma.cuh).
//
// Why: tmix_head_kernel keeps its state rows in registers, so a block's bytes in flight end with
// its loads, and each block then spends most of its life (column work, steps, GroupNorm, two
// barriers) with nothing in flight: latency, not bytes, sets its rate. Here grid (H, K): block
// (h, j) owns heads (b, h) for b = j, j + K, ... Its STAGES shared-memory slots each hold one
// head's state (N x N, as stored) and its 8 activation vectors; thread 0 keeps STAGES heads'
// copies in flight (cp.async.bulk, one mbarrier per slot) and refills a slot as soon as the block
// has read it. So the state stream never drains while the block computes, and the head's per-head
// weight vectors are loaded once per block, not once per head. An fp32 state gains nothing from
// this (its head kernel already holds enough bytes in flight), so it keeps the head kernel.
//
// Per head n (thread layout as tmix_head_kernel's, from wkv7_tmix_head.cuh; 128 threads):
//   3. row steps (mma_rows: state rows from the slot, new rows stored to global, GroupNorm sums);
//   then head n + 1's column work (2.: wait for its slot, then mma_columns) -> ONE barrier
//   (head n's slot is free: refill it) -> 4b. head n's output.
// The small per-head vectors (MmaCols) are triple-buffered by head (n % 3) so that head n + 1's
// column work never overwrites what head n's rows or output still read.
#include "pdl.cuh"
#include "wkv7_tmix_head.cuh"
#include "wkv7_tmix_mma.cuh"

namespace wkv7 {
namespace pipe {

constexpr int RPT = 4;
constexpr int T = N * TPR / RPT;       // 128 threads
constexpr int NV = 8;                  // activation vectors per head: r k v wz az g [vz v_first]
[[maybe_unused]] constexpr int STAGES = 2;  // shared-memory slots per block (heads in flight)
static_assert(T == head_threads<RPT>(), "the head kernel's thread layout");

// The tensor-core rows need no column registers: 74-76 registers, 6 blocks per SM.
constexpr int MIN_BLOCKS = 6;

// The layout this kernel is written for: a 16-bit state, head size 64 (wkv7_tmix_mma.cuh).
template <typename S>
__host__ __device__ constexpr bool pipe_ok() { return sizeof(S) == 2 && N == MN && head_ok<RPT>(); }

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

template <typename F, typename S>
__global__ void __launch_bounds__(T, MIN_BLOCKS)
    tmix_pipe_kernel(S *__restrict__ state, long long s_bstride, TmixArgs p, int B) {
    static_assert(pipe_ok<S>(), "the MMA row phase is for a 16-bit state with head size 64");
    using SL = Slot<F, S>;
    extern __shared__ __align__(128) unsigned char dyn[];
    __shared__ __align__(16) MmaCols hb[3];  // head n's vectors in hb[n % 3]
    __shared__ __align__(8) uint64_t bars[STAGES];
    const int h = blockIdx.x, j0 = blockIdx.y, K = gridDim.y, tid = threadIdx.x;
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

    // per-head weight vectors (this block's head only): once per block, before the wait (pdl.cuh)
    MmaConsts w;
    w.template load<F>(p, hc, tid);
    rwkv_pdl::pdl_wait();
    rwkv_pdl::pdl_trigger();
    if (tid == 0)
        for (int n = 0; n < STAGES && n < items; n++) issue_acts(n);

    // 2. per-column vectors of head n, from its slot, into buffer n % 3 (returns this thread's gate)
    auto columns = [&](int n) {
        const int s = n % STAGES, d = n % 3;
        mbar_wait(&bars[s], (n / STAGES) & 1);
        const HeadActs<F> x{act(s, 0), act(s, 1), act(s, 2), act(s, 3), act(s, 4), act(s, 5), act(s, 6), act(s, 7)};
        return mma_columns<F>(x, w, l0, tid, hb[d]);
    };
    // 3. the row steps of head n: rows from its slot, new rows straight to the pool; 4a. the
    // GroupNorm sums over the head's N rows
    auto rows = [&](int n) {
        const S *sst = (const S *)(dyn + (n % STAGES) * SL::BYTES);
        S *shead = state + seq(n) * s_bstride + (long long)h * N * N;
        mma_rows(sst, shead, hb[n % 3], tid);
    };
    // 4b. head n's output
    auto output = [&](int n, float g_o) {
        const MmaCols &c = hb[n % 3];
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

// Blocks per head K: at most one full wave (occupancy x SMs, or cap x SMs where cap > 0 is fewer
// blocks per SM than fit), then as few as give every block the same number of heads (ceil(B / K) each).
template <typename F, typename S>
int launch(int B, int H, S *state, long long s_bstride, const TmixArgs &p, int cap, cudaStream_t stream) {
    constexpr int smem = STAGES * Slot<F, S>::BYTES;
    static int per_sm = 0;  // per instantiation (one device per process in the server)
    if (per_sm == 0) {
        cudaError_t e = cudaFuncSetAttribute(tmix_pipe_kernel<F, S>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
        if (e == cudaSuccess) e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, tmix_pipe_kernel<F, S>, T, smem);
        if (e != cudaSuccess) return (int)e;
        if (per_sm <= 0) return -2;
    }
    const int slots = (cap > 0 && cap < per_sm ? cap : per_sm) * num_sms();
    int K = slots / H;  // rounded down: one block over a full wave would double the kernel's tail
    K = K < 1 ? 1 : (K > B ? B : K);
    const int per_block = (B + K - 1) / K;
    K = (B + per_block - 1) / per_block;
    if (K > 65535) return -2;
    return (int)rwkv_pdl::launch_pdl(tmix_pipe_kernel<F, S>, dim3(H, K), dim3(T), smem, stream, state, s_bstride, p, B);
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

// -2 when the pipelined kernel does not apply (the caller takes tmix_head_kernel): an fp32 state,
// a head size other than 64, unaligned inputs. The bulk copies need sm_90, the MMAs sm_80.
int tmix_pipe_launch(int f_dt, int s_dt, void *state, long long s_bstride, int B, int H, const TmixArgs &p,
                     int per_sm_cap, cudaStream_t stream) {
    return WKV7_DISPATCH(f_dt, s_dt, {
        if constexpr (pipe::pipe_ok<S>()) {
            if (!pipe_aligned(state, s_bstride * (long long)sizeof(S), p, p.act_bstride * (long long)sizeof(F)))
                return -2;
            return pipe::launch<F, S>(B, H, (S *)state, s_bstride, p, per_sm_cap, stream);
        } else {
            return -2;
        }
    });
}

}  // namespace wkv7
