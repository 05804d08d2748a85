"""What the kernel library exports: its CUDA sources and the C signature of each entry point.

One table, read by kernels.loader (which builds the library and binds these functions). Every
entry point returns int (0 = launched, else a CUDA error code) and takes plain C arguments:

    "i"  int         "ll" long long        "f" float        "p" pointer (a Python int: a
    tensor's data_ptr(), a CUDA stream handle, or 0 for NULL)

To add a kernel: put its .cu file in SOURCES (headers in HEADERS) and its extern "C" launcher's
argument codes here, in order.
"""

SOURCES = (
    "wkv7_decode.cu",
    "wkv7_chunk.cu",
    "wkv7_blocks.cu",
    "wkv7_tmix_fused.cu",
    "wkv7_tmix_pipe.cu",
    "fused_elementwise.cu",
    "prefill_elementwise.cu",
    "gemv.cu",
    "gemv_sparse.cu",
    "quant.cu",
    "sampler.cu",
)
HEADERS = (
    "wkv7_common.cuh",
    "wkv7_tmix.cuh",
    "wkv7_tmix_head.cuh",
    "wkv7_tmix_mma.cuh",
    "pdl.cuh",
    "sampler_common.cuh",
    "sampler_select.cuh",
    "sampler_walk.cuh",
)

I, LL, F, P = "i", "ll", "f", "p"
SIGNATURES: dict[str, list[str]] = {
    # f_dt, s_dt, raw_w, state, s_bstride, slots, B, H, r, w, k, v, a, b,
    # act_bstride, w_bstride, y, y_bstride, stream
    "wkv7_decode": [I, I, I, P, LL, P, I, I, P, P, P, P, P, P, LL, LL, P, LL, P],
    # f_dt, s_dt, raw_w, state, s_bstride, slots, lengths, B, T, H, r, w, k, v, a, b,
    # act_bstride, act_tstride, w_bstride, w_tstride, y, y_bstride, y_tstride, stream
    "wkv7_chunk": [I, I, I, P, LL, P, P, I, I, I, P, P, P, P, P, P, LL, LL, LL, LL, P, LL, LL, P],
    # wkv7_blocks.cu: wkv7_chunk's arguments with the fp32 work buffer before the stream
    "wkv7_blocks": [I, I, I, P, LL, P, P, I, I, I, P, P, P, P, P, P, LL, LL, LL, LL, P, LL, LL, P, P],
    "wkv7_blocks_record": [I],  # head size -> floats of one block's record (-1: not built for it)
    # f_dt, s_dt, pipe_min_b (the pipelined kernel for a 16-bit state from this batch on),
    # pipe_per_sm (its resident blocks per SM, 0 = as many as fit), state, s_bstride, B, H, r, k, v, wz, az, vz, v_first, g, act_bstride, k_k, k_a, r_k, lnx_w, lnx_b,
    # layer0, gn_eps, out, out_bstride, w0, a0, v0, stream
    "wkv7_tmix_fused": [I, I, I, I, P, LL, I, I] + [P] * 8 + [LL] + [P] * 5 + [I, F, P, LL, P, P, P, P],
    # fused_elementwise.cu: f_dt, B, C, x, x_bs, dx, dx_bs, ln_w, ln_b, eps, shift, shift_bs, mix, K,
    # x_out, xo_bs, out, out_bs, out_plane, dx_rs, dx_cs, dx_mul, stream
    "fused_add_ln_mix": [I, I, I, P, LL, P, LL, P, P, F, P, LL, P, I, P, LL, P, LL, LL, P, P, F, P],
    # f_dt, B, C, x, x_bs, dx, dx_bs, ln_w, ln_b, eps, shift, shift_bs, mix, K, nq, keep, x_out, xo_bs,
    # out, out_bs, out_plane, q, q_bs, q_plane, q_scale, dx_rs, dx_cs, dx_mul, stream
    "fused_add_ln_mix_q": [I, I, I, P, LL, P, LL, P, P, F, P, LL, P, I, I, I, P, LL, P, LL, LL, P, LL, LL, P, P, P, F, P],
    "fused_relu_square": [I, P, LL, P],  # f_dt, h, n, stream
    # prefill_elementwise.cu: f_dt, B, T, C, x, shift, shift_bs, mix, K, out, stream
    "prefill_token_mix": [I, I, I, I, P, P, LL, P, I, P, P],
    # f_dt, rows, H, k, v, wz, az, vz, v_first, w0, a0, v0, k_k, k_a, k_a1, b, stream
    "prefill_tmix_prep": [I, LL, I] + [P] * 14,
    # f_dt, rows, H, y, r, k, v, g, r_k, lnx_w, lnx_b, eps, out, stream
    "prefill_tmix_post": [I, LL, I] + [P] * 8 + [F, P, P],
    "fused_lora_act": [I, P, LL, P, LL, P],  # f_dt, a, na, g, ng, stream
    # gemv.cu: f_dt, w_dt (0 as f_dt, 1 int8, 2 fp8 e4m3), M, N, K, P, x, x_stride, x_pstride, w,
    # w_pstride, scale (8-bit weights' fp32 per-row scales), s_pstride, out, o_stride, o_pstride,
    # warps, cfg, act (0 none, 1 relu^2 on x), lim (per-plane widths / 8, 8 bits each), lim_kind (0 none,
    # 1 rows, 2 columns), stream (returns -2 = layout not covered: use the fallback)
    "gemv": [I, I, I, I, I, I, P, LL, LL, P, LL, P, LL, P, LL, LL, I, I, I, LL, I, P],
    # gemv_sparse.cu: w_dt (0 fp16, 1 int8, 2 fp8 e4m3), N, K, x, wt (K, N), scale (0 for fp16), out,
    # part (workspace slices x N fp32), count (workspace, one uint32 per group of 256 (fp16) / 512
    # outputs), slices, ks (inputs per slice), warps, stream (returns -2 = not covered: use the gemv)
    "gemv_sparse": [I, I, I, P, P, P, P, P, P, I, I, I, P],
    # quant.cu: f_dt, rows, K, x, x_stride, act (1: relu^2 first), q, q_stride, scale, stream
    "quant_rows_fp8": [I, I, I, P, LL, I, P, LL, P, P],
    # fused_elementwise.cu, a test hook: mode (0 plain launches, 1 programmatic dependent launch
    # where supported, -1 query); returns the previous state (0 / 1)
    "pdl_mode": [I],
    # sampler.cu: logits, lg_stride, penalty, pen_stride, seen, seen_stride, fparams, iparams,
    # positions, commit, greedy_only, B, V, out, dbg, lg_dt (0 fp32, 1 fp16, 2 bf16), cl (cluster
    # size for V <= 65536: 4 or 3, 0 = by batch), stream (returns -2 = V, dtype or cl not covered);
    # fparams' and iparams' columns: server.model.cuda_sampler.KERNEL_FPARAMS / KERNEL_IPARAMS
    "sampler_step": [P, LL, P, LL, P, LL, P, P, P, P, I, I, I, P, P, I, I, P],
}
