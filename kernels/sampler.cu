// Fused sampler step: one launch does what server.engine.sampler.sample() does for every row
// (penalised logits, greedy argmax or softmax -> top-p -> top-k -> temperature -> inverse CDF
// with the (seed, pos) counter random, then the penalty / seen update of committing rows).
// Pure-torch twin (the reference): server.engine.sampler.sample with CANDIDATES = () (a stable
// full sort of every row). Wrapper: server.model.cuda_sampler.fused_sample.
//
// Layout: one thread-block CLUSTER of CL CTAs (1024 threads each) per row; CTA r of the cluster
// owns tokens [r*n_loc, (r+1)*n_loc) and keeps them in shared memory for the whole step:
// z = logits - penalty (fp32) and key = the fp32 bits of p = softmax(z) (p >= 0, so the bits
// order like the values). CL = 4 for V <= 65536 (128 KiB of z + keys per CTA), 8 up to 131072;
// CL = 3 for V <= 65544 at large batch (175 KiB per CTA, 10-bit digits: Cfg).
// Cross-CTA reductions and histograms go through distributed shared memory (cluster.sync).
// The grid is at most one wave of clusters (rows_per_wave); a cluster takes rows blockIdx.y,
// + gridDim.y, ... and, once a row's inputs are in shared memory, asks the L2 for its next row's
// logits and penalty (bulk prefetch), so that they stream in during the select phases.
// The step is latency bound (one 1024-thread CTA per SM; far above its memory time), so the
// code keeps the barriers per radix pass to one cluster.sync + one __syncthreads, and no phase
// has one warp working serially while the others wait (see radix_select, cl_reduce).
//
// Exact by construction (no candidate limit): the canonical order of the cuts is (p descending,
// id ascending), as a stable full sort. Each cut's threshold is found by a radix select over the
// 31-bit keys (<= 3 passes of <= 11-bit digits, 10-bit with 3-CTA clusters, below the common
// prefix of the range; histograms of count + 64-bit fixed-point mass, combined over the cluster);
// the draw walks the kept tokens in id order (a block + cluster prefix scan, sample_walk).
// Steps for a sampled row (T > 0):
//   1. m = max z (argmax: first index of the max, as torch.argmax); greedy rows stop here.
//   2. S = sum exp(z - m) as an exact fixed-point sum (2^-47 units, order independent), rounded
//      once to fp32; p_i = expf(z_i - m) / S (IEEE division), the same formula as torch.softmax
//      (exp(x - max) / sum) except that torch's fp32 S is summed in its own order.
//   3. top-p: c* = the p value with mass(p > c*) < top_p <= mass(p >= c*) (masses are exact sums
//      of the fp32 p values in 2^-46 units): what the reference's first rank with cum >= top_p
//      gives in exact arithmetic. top_p >= 1 keeps every token (the reference may cut a tail
//      whose fp32 cumsum already reached 1.0); mass < top_p everywhere keeps every token (the
//      reference's clamp); top_p <= 0 (or NaN) keeps the maximum's tie group.
//   4. top-k (0 < k < n kept): the k-th largest key k*, all tokens with p > k*, and the first
//      k - count(p > k*) tokens with p == k* in id order.
//   5. weights w = expf((z - z_top) / T) (z_top = z of the rank-0 token), exact fixed-point sums
//      (2^-46 units, w truncated into them); W = their total, t = floor(W * u) in double (u =
//      uniform(seed, pos), bit-exact splitmix64 stream); the token = the first kept token in id
//      order whose cumulative weight > t (the inverse CDF of the kept set in id order, as
//      torch.multinomial walks a row: the same distribution as any order, and no select).
//   A row with no finite z (all NaN: the model overflowed, as a state of extreme values makes it)
//   gets NONFINITE_TOKEN (-3) and no penalty count (its decay is written by the load pass all the
//   same); the scheduler fails that request. A row with only some NaN or +inf z is sampled
//   as the phases below make of it (a token, unspecified); the torch twin fails such a row too.
//   6. commit rows: penalty *= decay (written in the load pass, z is kept in shared memory),
//      penalty[t] += seen[t] ? repetition : presence, seen[t] = 1.
// Where this can differ from the reference (all near ties, see test_sampler_kernel_gpu.py):
//   * S: torch sums exp in fp32 in its own order, so S (hence some p) may differ by an ulp;
//   * cum: the reference's fp32 top-p cumsum carries rounding (~1e-7 * sqrt(n) relative); the
//     kernel's masses are exact, so a top-p boundary within that error can flip (the inverse
//     CDF's sums are the same fixed-point integers in both);
//   * top_p >= 1 (above); w clamped to <= 1.9 (only reachable with z_top < z_max by an expf
//     tie and a tiny T); rows with some NaN or +inf z (above).
// Deterministic: every sum is an integer sum, so the result does not depend on the launch,
// the batch, or the cluster split (a row gives the same token alone or in any batch).
// Files: sampler_common.cuh (Args, Cfg, shared memory, the load pass, shuffles, cl_reduce, Row, fixed point),
// sampler_select.cuh (radix_select), sampler_walk.cuh (block_scan, cl_prefix, sample_walk); this file: the
// kernel, its launch configuration and the C entry point.
#include "sampler_common.cuh"
#include "sampler_select.cuh"
#include "sampler_walk.cuh"

namespace sampler_k {

template <int CL>
__global__ void __cluster_dims__(CL, 1, 1) __launch_bounds__(THREADS, 1) sampler_kernel(Args a) {
    using Shared = typename Cfg<CL>::Shared;
    constexpr int BINS = Cfg<CL>::BINS;
    extern __shared__ __align__(16) unsigned char smem[];
    Shared &sh = *reinterpret_cast<Shared *>(smem);
    float *zs = reinterpret_cast<float *>(smem + sizeof(Shared));
    unsigned *ks = reinterpret_cast<unsigned *>(zs + a.n_loc);
    cg::cluster_group cl = cg::this_cluster();
    const int rank = (int)cl.block_rank();
    const int base = rank * a.n_loc;
    const int cnt = max(0, min(a.n_loc, a.V - base));
    // rows blockIdx.y, + gridDim.y, ... (the loop and the next-row prefetch: see the top)
    for (long long row = blockIdx.y; row < a.B; row += gridDim.y) {
        int xs = 0, hs = 0;

        const float T = a.fparams[row * 5 + 0], top_p = a.fparams[row * 5 + 1];
        const float decay = a.fparams[row * 5 + 4];
        const long long top_k = a.iparams[row * 2 + 0], seed = a.iparams[row * 2 + 1];
        const bool commit = a.commit[row] != 0;
        const bool greedy = a.greedy_only || !(T > 0.f);

        // 1. z = logits - penalty into shared memory; decayed penalty written back (commit rows).
        //    Both histogram slots start zeroed (radix_select keeps them so; the barrier of the
        //    first reduction orders this before any atomics).
        if (!greedy)
            for (int b = threadIdx.x; b < BINS; b += THREADS)
#pragma unroll
                for (int j = 0; j < 2; j++) sh.hcnt[j][b] = sh.hlo[j][b] = sh.hhi[j][b] = 0;
        const long long lg0 = row * a.lg_s + base;
        float *pen = a.penalty + row * a.pen_s + base;
        MaxArg mx = load_row(a, lg0, pen, zs, base, cnt, commit && decay != 1.f, decay);
        if (a.prefetch && row + gridDim.y < a.B && threadIdx.x < 32) {  // this CTA's slice of the next row
            const long long nr = row + gridDim.y, es = a.lg_dt ? 2 : 4;
            prefetch_l2(static_cast<const char *>(a.logits) + (nr * a.lg_s + base) * es, cnt * es, threadIdx.x);
            prefetch_l2(a.penalty + nr * a.pen_s + base, cnt * 4ll, threadIdx.x);
        }
        mx = cl_reduce<CL>(cl, sh, xs, mx, OpMaxArg());
        // no z won the max: every z NaN (a model that overflowed) or -inf: no token (the same in
        // every CTA: a uniform branch past the sampling phases)
        const bool none = mx.i == 0x7fffffff || mx.v == -INFINITY;  // (-inf ties win by index)
        const float m = mx.v;
        int tok = none ? NONFINITE_TOKEN : mx.i;
        // dbg (rank 0, thread 0): each value is written where it is known (short live ranges: the
        // kernel runs at the 64-register limit); greedy rows keep the defaults
        float *const d = a.dbg && rank == 0 && threadIdx.x == 0 ? a.dbg + row * 8 : nullptr;
        if (d) d[0] = m, d[1] = 0.f, d[2] = 0.f, d[3] = (float)a.V, d[4] = 0.f, d[5] = 0.f, d[6] = 0.f, d[7] = 0.f;

        Pick pk{0ull, 0ull, 0x7fffffff};  // a sampled row's draw (W = 0: none, the argmax stands)
        if (!greedy && !none) {
            // 2. S (exact fixed-point sum of exp(z - m)), then the keys
            u64 es = 0;
            for (int i = threadIdx.x; i < cnt; i += THREADS) {
                const float e = expf(zs[i] - m);
                ks[i] = __float_as_uint(e);
                es += __float2ull_rz(e * FIX47);
            }
            es = cl_reduce<CL>(cl, sh, xs, es, OpSum());
            const float S = __ull2float_rn(es) * (1.0f / FIX47);
            if (d) d[1] = S;
            const unsigned kmax = __float_as_uint(__fdiv_rn(1.0f, S));
            // keys p = e / S, and z of the rank-0 token: the smallest id with the largest key
            // (usually the argmax; this thread's ids ascend, so its first hit is its smallest)
            MinTok t0{0x7fffffff, 0.f, 0xffffffffu};
            for (int i = threadIdx.x; i < cnt; i += THREADS) {
                const unsigned k = __float_as_uint(__fdiv_rn(__uint_as_float(ks[i]), S));
                ks[i] = k;
                if (k == kmax && base + i < t0.i) t0.i = base + i, t0.z = zs[i];
                t0.kmin = min(t0.kmin, k);
            }
            t0 = cl_reduce<CL>(cl, sh, xs, t0, OpMinTok());
            Row r{zs, ks, cnt, base, t0.i == 0x7fffffff ? m : t0.z, T};
            const unsigned kmin = min(t0.kmin, kmax);

            // 3. top-p cutoff c*
            unsigned cstar = 0;  // key 0: every token kept
            long long n_p = a.V;
            if (!(top_p >= 1.0f)) {  // NaN: like top_p = 0 (the reference's cum < NaN is false)
                const u64 tp = top_p > 0.f ? (u64)ceil((double)top_p * 70368744177664.0) : 0ull;
                const Sel s = radix_select<CL>(cl, sh, hs, r, MASS, kmin, kmax, tp);
                if (s.found) cstar = s.key, n_p = (long long)s.cnt_above + s.cnt_at;
            }
            if (d) d[2] = __uint_as_float(cstar), d[3] = (float)n_p;
            // 4. top-k
            unsigned kthr = cstar;
            long long lim = 0x7fffffffffffffffll;
            if (top_k > 0 && top_k < n_p) {
                const Sel s = radix_select<CL>(cl, sh, hs, r, COUNT, kmin, kmax, (u64)top_k);
                kthr = s.key;
                lim = top_k - (long long)s.cnt_above;
            }
            if (d) d[4] = __uint_as_float(kthr), d[5] = (float)(lim > (1ll << 40) ? -1 : lim);
            // 5. the inverse CDF over the kept tokens in id order
            const u64 zz = splitmix64(splitmix64((u64)seed) + (u64)a.pos[row]);
            const float u = (float)(zz >> 40) * (1.0f / 16777216.0f);
            pk = sample_walk<CL>(cl, sh, xs, r, kthr, lim, u);
            if (d) d[6] = (float)((double)pk.W / 70368744177664.0), d[7] = (float)((double)pk.t / 70368744177664.0);
        }

        // 6. penalty / seen of the chosen token, and the output: by the thread that found it in a
        //    sampled row (its CTA owns the token), else by the owner CTA's thread 0 (the argmax;
        //    the decay above is visible after the barrier)
        __syncthreads();
        const bool walked = pk.W > 0;  // the same in every thread
        const bool mine = walked ? pk.found != 0x7fffffff : threadIdx.x == 0 && tok >= base && tok < base + cnt;
        if (walked) tok = pk.found;
        if (mine && commit) {
            unsigned char *sn = a.seen + row * a.seen_s;
            const bool was = sn[tok] != 0;
            float *pp = a.penalty + row * a.pen_s + tok;
            *pp = *pp + (was ? a.fparams[row * 5 + 3] : a.fparams[row * 5 + 2]);  // repetition : presence
            sn[tok] = 1;
        }
        if (walked ? mine : threadIdx.x == 0 && rank == 0) a.out[row] = tok;
        cl.sync();  // no CTA exits while another may still read its shared memory
    }
}

// The opt-in to > 48 KiB of shared memory for sampler_kernel<CL>, once per device (the first call
// is eager: the engine's warm-up runs before any CUDA-graph capture).
template <int CL>
cudaError_t prepare(int dev) {
    static bool done[64] = {};  // per device (one table per cluster size: a static of prepare<CL>)
    if (done[dev & 63]) return cudaSuccess;
    const int bytes = (int)(sizeof(typename Cfg<CL>::Shared) + (size_t)Cfg<CL>::MAX_LOCAL * 8);
    const cudaError_t e = cudaFuncSetAttribute(sampler_kernel<CL>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    done[dev & 63] = e == cudaSuccess;
    return e;
}

// Rows of CL-CTA clusters resident at once on this device (its GPCs decide: on the H200 30 for
// CL = 4, 39 for CL = 3), once per device; 0 if unknown.
template <int CL>
int rows_per_wave(int dev) {
    static int rows[64] = {};
    int &r = rows[dev & 63];
    if (r == 0 && prepare<CL>(dev) == cudaSuccess) {
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(CL, 1024);
        cfg.blockDim = dim3(THREADS);
        cfg.dynamicSmemBytes = sizeof(typename Cfg<CL>::Shared) + (size_t)Cfg<CL>::MAX_LOCAL * 8;
        cudaLaunchAttribute at;
        at.id = cudaLaunchAttributeClusterDimension;
        at.val.clusterDim.x = CL, at.val.clusterDim.y = 1, at.val.clusterDim.z = 1;
        cfg.attrs = &at, cfg.numAttrs = 1;
        if (cudaOccupancyMaxActiveClusters(&r, (void *)sampler_kernel<CL>, &cfg) != cudaSuccess) {
            cudaGetLastError();
            r = -1;
        }
    }
    return r > 0 ? r : 0;
}

template <int CL>
int launch(const Args &a, int B, cudaStream_t st) {
    int dev = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e == cudaSuccess) e = prepare<CL>(dev);
    if (e != cudaSuccess) return (int)e;
    const size_t bytes = sizeof(typename Cfg<CL>::Shared) + (size_t)a.n_loc * 8;
    const int wave = rows_per_wave<CL>(dev);  // 0: unknown, a cluster per row
    const int G = wave > 0 && wave < B ? wave : B;
    Args b = a;
    b.B = B, b.prefetch = G < B;
    // every CTA's slice starts 16-byte aligned: 4-token vectors in the load pass (n_loc % 4 == 0)
    const bool al = (uintptr_t)a.logits % 16 == 0 && (uintptr_t)a.penalty % 16 == 0;
    b.vec = al && a.lg_s % 4 == 0 && a.pen_s % 4 == 0 && a.n_loc % 4 == 0;
    sampler_kernel<CL><<<dim3(CL, G), THREADS, bytes, st>>>(b);
    return (int)cudaGetLastError();
}

// The cluster size for V <= 65536 when the caller leaves it open: 4 while the rows fit in one
// wave of 4-CTA clusters (shorter rows per CTA), else 3 (more rows per wave: fewer waves).
inline int auto_cluster(int B) {
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) return 4;
    const int wave = rows_per_wave<4>(dev);
    return wave > 0 && B > wave ? 3 : 4;
}

}  // namespace sampler_k

// One sampler step for rows [0, B). logits (B, V) fp32 / fp16 / bf16 (lg_dt 0 / 1 / 2) rows lg_s apart; penalty (B, V) fp32
// rows pen_s apart (updated); seen (B, V) bool rows seen_s apart (updated); fparams (B, 5) fp32,
// iparams (B, 2) int64, positions (B,) int64, commit (B,) bool: contiguous; out (B,) int64;
// dbg: null or (B, 8) fp32 (m, S, c*, n kept by top-p, top-k threshold, its group limit,
// total weight, target). cl: the cluster size for V <= 65536, 4 or 3 (the large-batch shape, see
// Cfg); 0 = auto_cluster(B); larger V always 8. The results do not depend on it.
// Returns 0, a CUDA error, or -2 (V, dtype or cl not covered: use the torch path).
extern "C" int sampler_step(void *logits, long long lg_s, void *penalty, long long pen_s, void *seen,
                            long long seen_s, void *fparams, void *iparams, void *positions, void *commit,
                            int greedy_only, int B, int V, void *out, void *dbg, int lg_dt, int cl, void *stream) {
    using namespace sampler_k;
    if (B <= 0) return 0;
    if (V <= 0 || V > 8 * MAX_LOCAL) return UNSUPPORTED;
    if (lg_dt < 0 || lg_dt > 2 || (cl != 0 && cl != 3 && cl != 4)) return UNSUPPORTED;
    Args a{logits, lg_s, static_cast<float *>(penalty), pen_s,
           static_cast<unsigned char *>(seen), seen_s, static_cast<const float *>(fparams),
           static_cast<const long long *>(iparams), static_cast<const long long *>(positions),
           static_cast<const unsigned char *>(commit), static_cast<long long *>(out), static_cast<float *>(dbg),
           greedy_only, V, 0, lg_dt, B, 0};
    cudaStream_t st = static_cast<cudaStream_t>(stream);
    if (cl == 0 && V <= 4 * MAX_LOCAL) cl = auto_cluster(B);
    // n_loc rounded up to 4 tokens (the vector load pass); MAX_LOCAL of every shape is a multiple of 4
    if (cl == 3 && V <= 3 * Cfg<3>::MAX_LOCAL) {
        a.n_loc = ((V + 2) / 3 + 3) & ~3;
        return launch<3>(a, B, st);
    }
    if (V <= 4 * MAX_LOCAL) {
        a.n_loc = ((V + 3) / 4 + 3) & ~3;
        return launch<4>(a, B, st);
    }
    a.n_loc = ((V + 7) / 8 + 3) & ~3;
    return launch<8>(a, B, st);
}
