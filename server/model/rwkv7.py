"""RWKV-7 forward: chunked ragged prefill and one-token batched decode, pure PyTorch.

The WKV recurrence goes through `self.ops` (server.model.ops, or its CUDA twin
server.model.cuda_ops when the model lives on CUDA and the kernels are built; see select_ops).
Everything else is plain torch: the T-token chunk of all sequences goes through each linear
layer as one GEMM.

With the CUDA twins: decode runs the fused path (_decode_fused): per layer one kernel for
residual add + ln1 + the six token-shift mixes + att_shift write (ops.add_ln_mix), the LoRA
activations in one launch (ops.lora_act), the fused time-mix core (ops.tmix_decode, one kernel
between the projections and the output projection, LoRA biases added inside), one kernel for
residual add + ln2 + ffn mix + ffn_shift write, and relu^2 with the value projection
(ops.relu2_linear: inside the gemv's x loads at batch <= 8, else relu_square in place); the
FFN's residual add goes into the next layer's (or the head's) add_ln_mix. Prefill uses long chunks (CUDA_CHUNK_LEN)
and hands ragged lengths and non-contiguous slots straight to the chunk kernel (no padding
masks, no gather/scatter of states). On the pure-torch path (CPU) nothing of that changes the
arithmetic: chunks of CPU_CHUNK_LEN, identity-step padding, gathered states.
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from server.config import CHOICES
from server.model import ops as torch_ops
from server.model.checkpoint import LayerWeights, Weights
from server.model.decode_pack import DecodePack, SideStream, pack_layer, side_streams
from server.model.qlinear import HEAD8_MAX_ROWS, Weight
from server.model.state import ModelShape, State

OP_NAMES = (
    "wkv_decode",
    "wkv_chunk",
    "tmix_decode",
    "add_ln_mix",
    "add_ln_mix_q",
    "quantizes_rows",
    "linear_q",
    "relu_square",
    "lora_act",
    "linear",
    "relu2_linear",
    "residual_linear",
    "dense",
    "token_mix",
    "tmix_prep",
    "tmix_post",
)
KERNELS = CHOICES["kernels"]
CUDA_CHUNK_LEN = 4096  # one chunk for a 4k prompt: long chunks keep the chunk kernel's GEMMs large
CPU_CHUNK_LEN = 256
MAX_CHUNK_TOKENS = 16384
"""Default cap on the padded tokens (sequences x chunk length) of one chunk: bounds the prefill
activations (~0.2 MB per token at 2.9B fp16, ~3.5 GB at the cap); the chunk length shrinks
when many sequences prefill together."""


def select_ops(device: torch.device, kernels: str = "auto", head_size: int = 64,
               cache_root: str | Path | None = None) -> types.SimpleNamespace:  # fmt: skip
    """The WKV primitives for `device`: each name from server.model.cuda_ops when on CUDA,
    kernels is auto or cuda, that module imports, its `available()` returns True for this head
    size (builds the kernels under cache_root on the first call: call at start-up only) and it
    defines the name; else the pure-torch one. kernels: auto | torch (pure torch) | cuda (the
    kernels or a RuntimeError)."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {', '.join(KERNELS)}, not {kernels!r}")
    chosen = {n: getattr(torch_ops, n) for n in OP_NAMES}
    if device.type == "cuda" and kernels in ("auto", "cuda"):
        try:
            from server.model import cuda_ops, cuda_prefill

            ok = cuda_ops.available(device, head_size, cache_root)
        except ImportError:
            ok = False
        if not ok and kernels == "cuda":
            raise RuntimeError("kernels='cuda' asked but server.model.cuda_ops is not available")
        if ok:
            for mod in (cuda_ops, cuda_prefill) if cuda_prefill.SELECTED else (cuda_ops,):
                chosen.update({n: getattr(mod, n) for n in OP_NAMES if hasattr(mod, n)})
    return types.SimpleNamespace(**chosen)


class RWKV7:
    def __init__(self, weights: Weights, shape: ModelShape, name: str, device, dtype: torch.dtype,
                 state_dtype: torch.dtype = torch.float32, chunk_len: int | None = None, kernels: str = "auto",
                 max_chunk_tokens: int | None = None, kernel_cache: str | Path | None = None):  # fmt: skip
        """chunk_len: prefill chunk length (default CUDA_CHUNK_LEN with the CUDA kernels, else
        CPU_CHUNK_LEN); max_chunk_tokens: cap on sequences x chunk length per chunk (default
        max(MAX_CHUNK_TOKENS, chunk_len)); kernels, kernel_cache: see select_ops."""
        self.w, self.shape, self.name = weights, shape, name
        self.synthetic = False  # random weights (a synthetic spec or a file written by save_synthetic)
        self.quant = "none"  # the layers' large linears in 8 bits (qlinear.WEIGHT_MODES), set by load_model
        self.device, self.dtype, self.state_dtype = torch.device(device), dtype, state_dtype
        self.ops = select_ops(self.device, kernels, shape.head_size, kernel_cache)
        self.chunk_len = chunk_len or (CUDA_CHUNK_LEN if self.kernel_ops() else CPU_CHUNK_LEN)
        self.max_chunk_tokens = max_chunk_tokens or max(MAX_CHUNK_TOKENS, self.chunk_len)
        self.fused_decode: bool | None = None
        """None: decode runs the fused path (_decode_fused) when ops.tmix_decode is the CUDA twin;
        True/False force it on/off (True on CPU runs the pure-torch twins: a layout check)."""
        self._packs: list[DecodePack] | None = None
        self._sides: dict[int, list[torch.cuda.Stream]] = {}  # current stream's handle -> its LoRA side stream
        if self._fused():
            self._decode_packs()  # before any graph capture; costs no memory (views)

    # ---- public API ------------------------------------------------------------------------
    def zero_state(self, batch: int) -> State:
        return State.zeros(self.shape, batch, self.device, self.dtype, self.state_dtype)

    @torch.no_grad()
    def forward(self, tokens: list[list[int]], state: State, slots: Sequence[int] | None = None) -> torch.Tensor:
        """Run tokens[i] on state slot slots[i] (default i); update state in place; return the
        logits after each sequence's last token: (B, V) fp32."""
        B = len(tokens)
        slots = list(range(B)) if slots is None else [int(s) for s in slots]
        self.check_forward(tokens, state, slots)
        lens = [len(t) for t in tokens]
        last_x = torch.empty(B, self.shape.n_embd, device=self.device, dtype=self.dtype)  # (B, C)
        c0, end = 0, max(lens)
        while c0 < end:
            act = [i for i in range(B) if lens[i] > c0]
            T = max(1, min(self.chunk_len, self.max_chunk_tokens // len(act)))
            chunk = [tokens[i][c0 : c0 + T] for i in act]
            x_end = self._prefill_chunk(chunk, state, [slots[i] for i in act])  # (len(act), C)
            done = [j for j, i in enumerate(act) if lens[i] <= c0 + T]
            if done:
                idx = torch.tensor(done, device=self.device)
                dst = torch.tensor([act[j] for j in done], device=self.device)
                last_x.index_copy_(0, dst, x_end.index_select(0, idx))
            c0 += T
        return self._head(last_x)

    @torch.no_grad()
    def decode(self, token_ids: torch.Tensor, state: State, raw_logits: bool = False) -> torch.Tensor:
        """One token per slot for all B slots of `state`: token_ids (B,) long -> (B, V) fp32.
        No Python loop over B and no host sync (CUDA-graph capturable). raw_logits: return the
        head's output in the model dtype instead (the same values: the fp32 cast is exact), for
        consumers that widen as they read (the fused sampler), saving a (B, V) fp32 copy."""
        if token_ids.shape != (state.batch_size,):
            raise ValueError(f"decode: token_ids {tuple(token_ids.shape)} for a state of batch {state.batch_size}")
        x = F.embedding(token_ids, self.w.emb)  # (B, C)
        if self._fused():
            logits = self._decode_fused(x, state)  # (B, V) model dtype
            return logits if raw_logits else logits.float()
        v_first, dx = x, None  # v_first: replaced in layer 0
        for i, lw in enumerate(self.w.layers):
            # x += dx (the previous layer's FFN); ln1; the six token-shift mixes (6, B, C)
            x, xs = self.ops.add_ln_mix(x, dx, lw.ln1_w, lw.ln1_b, lw.mix, state.att_shift[i])
            dx, v_first = self._time_mix(i, lw, xs, state.wkv[i], v_first, None)
            x, xk = self.ops.add_ln_mix(x, dx, lw.ln2_w, lw.ln2_b, lw.ffn_xk.view(1, -1), state.ffn_shift[i])
            dx = self._channel_mix(lw, xk[0])
        assert dx is not None  # a model has layers
        x = x + dx
        return self._head(x, raw_logits)

    # ---- internals -------------------------------------------------------------------------
    def _decode_fused(self, x: torch.Tensor, state: State) -> torch.Tensor:
        """decode() on the fused path (x: (B, C) embeddings); returns the logits (B, V) in the
        model dtype. The same arithmetic as the unfused loop, with the elementwise work in
        self.ops' fused ops (one launch each on CUDA) and the projections that share a launch
        stacked (server.model.decode_pack)."""
        lin, C = self.ops.linear, self.shape.n_embd
        dx, v_first = None, x
        for i, (lw, pk) in enumerate(zip(self.w.layers, self._decode_packs())):
            # x <- x + dx (the previous layer's FFN output); the six mixes from ln1(x), att_shift:
            # (6, B, C) g w a v k r, or the LoRAs' planes and v k r as e4m3 rows for an fp8 product
            x, xs, xq = self._ln_mix(x, dx, lw.ln1_w, lw.ln1_b, pk.mix, state.att_shift[i], pk.vkr, pk.lora1.shape[0])
            side = self._fork()  # the LoRAs run beside the big projection (CUDA: a side stream)
            with side:
                z, gz = self._decode_loras(xs, pk)  # (P, B, C) wz, az[, vz]; (B, C) gate
            v, k, r = (lin(xs[3:6], pk.vkr) if xq is None else self.ops.linear_q(xq, pk.vkr)).unbind(0)  # (B, C)
            side.join()
            if i == 0:
                v_first = v
            # (B, C); the LoRA biases w0 / a0 / v0 are added inside
            y = self.ops.tmix_decode(
                state.wkv[i], r, k, v, z[0], z[1], z[2] if i else None, v_first, gz, lw, layer0=i == 0, bias=True
            )
            # the two products that only feed a residual add: residual_linear (an fp8 one may leave
            # its scales to add_ln_mix)
            x, xk, kq = self._ln_mix(x, self.ops.residual_linear(y, lw.wo), lw.ln2_w, lw.ln2_b,
                                     lw.ffn_xk.view(1, C), state.ffn_shift[i], lw.ffn_key, 0)  # fmt: skip
            h = lin(xk[0], lw.ffn_key) if kq is None else self.ops.linear_q(kq.plane(0), lw.ffn_key)  # (B, 4C)
            dx = self.ops.residual_linear(h, lw.ffn_value, lw.ffn_value_t, act=True)
        _, xn = self.ops.add_ln_mix(x, dx, self.w.ln_out_w, self.w.ln_out_b, None, None)
        return lin(xn, self._head_weight(xn.shape[0]))  # (B, V) model dtype

    def _ln_mix(self, x, dx, ln_w, ln_b, mix, shift, w: Weight, keep: int):
        """ops.add_ln_mix -> (x', planes (K, B, C), None); or, where w's product reads its rows as
        e4m3 codes (ops.quantizes_rows), (x', planes k < keep, the last planes that w multiplies
        (one per plane of w) as QRows) from one add_ln_mix_q, which quantizes them as it goes."""
        if self.ops.quantizes_rows(w, x.shape[0]):
            return self.ops.add_ln_mix_q(x, dx, ln_w, ln_b, mix, shift, w.shape[0] if len(w.shape) == 3 else 1, keep)
        return (*self.ops.add_ln_mix(x, dx, ln_w, ln_b, mix, shift), None)

    def _decode_loras(self, xs: torch.Tensor, pk: DecodePack) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode LoRAs from the token-shift planes xs (6, B, C): (wz, az[, vz]) stacked
        (P, B, C) without their biases, and the gate (B, C); one launch per stage."""
        lin, Q = self.ops.linear, pk.lora1.shape[0]
        d = pk.gate_apart(xs.shape[1])
        if d:
            return self._decode_loras_apart(xs, pk, d)
        mid = lin(xs[:Q], pk.lora1, rows=pk.widths)  # (Q, B, D) gate, decay, a[, v-mix] hidden
        self.ops.lora_act(mid[1], mid[0])  # tanh on the decay plane, sigmoid on the gate's; in place
        out = lin(mid, pk.lora2, cols=pk.widths)  # (Q, B, C) gate, wz, az[, vz]
        return out[1:], out[0]

    def _decode_loras_apart(self, xs: torch.Tensor, pk: DecodePack, d: int) -> tuple[torch.Tensor, torch.Tensor]:
        """_decode_loras at a large batch: the gate's LoRA (width D) on a stream of its own beside
        the others, which stack at their widest width d (DecodePack.gate_apart)."""
        lin, Q = self.ops.linear, pk.lora1.shape[0]
        gate = self._fork()
        with gate:
            hg = lin(xs[0], pk.lora1[0])  # (B, D) gate hidden
            self.ops.lora_act(hg[:0], hg)  # sigmoid, in place
            gz = lin(hg, pk.lora2[0])  # (B, C)
        hw = lin(xs[1:Q], pk.lora1[1:, :d])  # (Q-1, B, d) decay, a[, v-mix] hidden
        self.ops.lora_act(hw[0], hw[0, :0])  # tanh on the decay plane, in place
        z = lin(hw, pk.lora2[1:, :, :d])  # (Q-1, B, C) wz, az[, vz]
        gate.join()
        return z, gz

    def _fork(self) -> SideStream:
        """A context that runs its body on a side stream forked from the current one (join()
        makes the current stream wait for it); on CPU both are no-ops. Each current stream has
        its own side stream, so decodes on different streams stay independent."""
        return side_streams(self.device, 1, self._sides)[0]

    def _decode_packs(self) -> list[DecodePack]:
        """The stacked decode weights (built once; the layers' fields become views into them)."""
        if self._packs is None:
            self._packs = [pack_layer(lw) for lw in self.w.layers]
        return self._packs

    def check_forward(self, tokens, state: State, slots: list[int]) -> None:
        if not tokens:
            raise ValueError("forward() needs at least one sequence")
        if any(len(t) == 0 for t in tokens):
            raise ValueError("forward() got an empty token sequence")
        if len(slots) != len(tokens) or len(set(slots)) != len(slots):
            raise ValueError("slots must be distinct, one per sequence")
        if min(slots) < 0 or max(slots) >= state.batch_size:
            raise ValueError(f"slot out of range [0, {state.batch_size})")
        V = self.shape.vocab_size
        if min(min(t) for t in tokens) < 0 or max(max(t) for t in tokens) >= V:
            raise ValueError(f"token id out of range [0, {V})")  # on CUDA it would kill the context

    def kernel_ops(self) -> bool:
        """True when self.ops are the CUDA twins (wkv_chunk takes slots=/lengths=)."""
        return self.ops.wkv_chunk is not torch_ops.wkv_chunk

    def _fused(self) -> bool:
        if self.fused_decode is not None:
            return self.fused_decode
        return self.ops.tmix_decode is not torch_ops.tmix_decode

    def _prefill_chunk(self, chunk: list[list[int]], state: State, slots: list[int]) -> torch.Tensor:
        """One chunk on state slots `slots`: a view when they are a contiguous ascending range;
        else the CUDA kernels index the pool (slots=), or (pure torch) a gathered copy."""
        s0 = slots[0]
        if slots == list(range(s0, s0 + len(slots))):
            return self._run_chunk(chunk, state.view(s0, s0 + len(slots)))
        if self.kernel_ops():
            return self._run_chunk(chunk, state, torch.tensor(slots, device=self.device))
        sub = state.gather(slots)
        x_end = self._run_chunk(chunk, sub)
        state.scatter(sub, slots)
        return x_end

    def _run_chunk(self, chunk: list[list[int]], state: State, sidx: torch.Tensor | None = None) -> torch.Tensor:
        """Prefill one chunk (right-padded) on state rows sidx (default all, in order); returns
        the residual stream at each last token."""
        B, T = len(chunk), max(len(t) for t in chunk)
        lens = torch.tensor([len(t) for t in chunk], device=self.device)  # (B,)
        ids = torch.zeros(B, T, dtype=torch.long)
        for j, t in enumerate(chunk):
            ids[j, : len(t)] = torch.tensor(t, dtype=torch.long)
        ids = ids.to(self.device)
        pad, kw = None, {}
        if self.kernel_ops():  # the kernel skips t >= lengths and indexes the pool by slot
            if any(len(t) != T for t in chunk):
                kw["lengths"] = lens.to(torch.int32)
            if sidx is not None:
                kw["slots"] = sidx.to(torch.int32)
        elif any(len(t) != T for t in chunk):
            pad = self._pad_mask(T, lens)
        return self._run_tokens(ids, lens, state, sidx, pad, kw)

    @torch.no_grad()
    def forward_padded(self, ids: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor, state: State):
        """forward() from device tensors, with no host sync (CUDA-graph capturable: the prefill
        graphs of server.model.prefill_graphs): ids (B, T) long, right-padded; lengths (B,)
        int32, each in [1, T]; slots (B,) int32, distinct rows of `state`, each updated as by
        its lengths[b] tokens. Returns the logits after each last token: (B, V) fp32. On the
        pure-torch ops (no graphs there) the rows are gathered and the padding masked, with a
        host sync: the same function, for the CPU tests."""
        lens = lengths.long()
        if self.kernel_ops():
            kw = {"lengths": lengths, "slots": slots}
            return self._head(self._run_tokens(ids, lens, state, slots.long(), None, kw))
        rows = [int(s) for s in slots.tolist()]
        sub = state.gather(rows)
        pad = self._pad_mask(ids.shape[1], lens)
        x_end = self._run_tokens(ids, lens, sub, None, pad, {})
        state.scatter(sub, rows)
        return self._head(x_end)

    def _pad_mask(self, T: int, lens: torch.Tensor) -> torch.Tensor:
        """(B, T, 1) True at the padding: positions t >= lens[b] of right-padded sequences."""
        return (torch.arange(T, device=self.device) >= lens[:, None]).unsqueeze(-1)

    def _run_tokens(self, ids, lens, state: State, sidx, pad, kw) -> torch.Tensor:
        """_run_chunk's layers from device tensors: ids (B, T), lens (B,) long; pad / kw: the
        padding as a mask (pure torch) or as the kernels' lengths (and slots)."""
        B = ids.shape[0]
        rows = torch.arange(B, device=self.device)
        last = lens - 1  # (B,)
        x = F.embedding(ids, self.w.emb)  # (B, T, C)
        v_first, dx = x, None
        for i, lw in enumerate(self.w.layers):
            x, xa = self._add_ln(x, dx, lw.ln1_w, lw.ln1_b)  # x += dx (the previous layer's FFN); ln1
            xs = self.ops.token_mix(xa, _rows(state.att_shift[i], sidx), lw.mix)  # (6, B, T, C)
            _put_rows(state.att_shift[i], sidx, xa[rows, last])
            dx, v_first = self._time_mix(i, lw, xs, state.wkv[i], v_first, pad, kw)
            x, xf = self._add_ln(x, dx, lw.ln2_w, lw.ln2_b)
            xk = self.ops.token_mix(xf, _rows(state.ffn_shift[i], sidx), lw.ffn_xk.view(1, -1))[0]  # (B, T, C)
            _put_rows(state.ffn_shift[i], sidx, xf[rows, last])
            dx = self._channel_mix(lw, xk)
        assert dx is not None  # a model has layers
        return x[rows, last] + dx[rows, last]  # (B, C)

    def _add_ln(self, x: torch.Tensor, dx: torch.Tensor | None, w: torch.Tensor, b: torch.Tensor):
        """(x + dx, layer_norm(x + dx)) for (B, T, C) x (x itself when dx is None): one
        ops.add_ln_mix over the B * T rows."""
        C = self.shape.n_embd
        xo, xn = self.ops.add_ln_mix(x.reshape(-1, C), None if dx is None else dx.reshape(-1, C), w, b, None, None)
        return xo.view_as(x), xn.view_as(x)

    def _ln(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (self.shape.n_embd,), w, b)

    def _time_mix(self, i: int, lw: LayerWeights, xs, wkv, v_first, pad, wkv_kw=None):
        """xs: the six token-shift mixes r w k v a g, (6, B, C) decode or (6, B, T, C) prefill;
        wkv: (B, H, N, N) updated in place (the whole pool when wkv_kw has slots); wkv_kw: extras
        for the CUDA wkv_chunk. Returns (the output projection's product, v_first)."""
        H, N = self.shape.n_head, self.shape.head_size
        xr, xw, xk, xv, xa, xg = xs.unbind(0)
        dense = self.ops.dense  # F.linear, or an 8-bit weight's product
        r, k, v = dense(xr, lw.wr), dense(xk, lw.wk), dense(xv, lw.wv)
        hw, hg = self.ops.lora_act(xw @ lw.w1, xg @ lw.g1)  # tanh, sigmoid: the decay and gate LoRAs' hidden
        vz = None
        if i > 0:  # layers after the first carry the value-mix LoRA
            assert lw.v1 is not None and lw.v2 is not None
            vz = (xv @ lw.v1) @ lw.v2
        w, k, v, a, b = self.ops.tmix_prep(k, v, hw @ lw.w2, (xa @ lw.a1) @ lw.a2, vz, v_first if i else None, lw, H)
        if i == 0:
            v_first = v
        if pad is not None:  # padded steps become identity steps of the recurrence
            w, k, b = w.masked_fill(pad, torch_ops.IDENTITY_W), k.masked_fill(pad, 0), b.masked_fill(pad, 0)
        hd = lambda t: t.unflatten(-1, (H, N))  # (..., C) -> (..., H, N)
        wkv_fn = self.ops.wkv_decode if r.dim() == 2 else self.ops.wkv_chunk
        y = wkv_fn(wkv, hd(r), hd(w), hd(k), hd(v), hd(a), hd(b), **(wkv_kw or {}))  # (..., H, N)
        y = self.ops.tmix_post(y.flatten(-2), r, k, v, hg @ lw.g2, lw, H)  # (..., C)
        return dense(y, lw.wo), v_first

    def _channel_mix(self, lw: LayerWeights, xk: torch.Tensor) -> torch.Tensor:
        """The FFN of the token-shift mix xk: value(relu(key(xk))^2)."""
        return self.ops.dense(self.ops.relu_square(self.ops.dense(xk, lw.ffn_key)), lw.ffn_value)

    def _head(self, x: torch.Tensor, raw: bool = False) -> torch.Tensor:
        x = self._ln(x, self.w.ln_out_w, self.w.ln_out_b)
        logits = self.ops.dense(x, self._head_weight(x.shape[0]))  # (B, V) model dtype; 8-bit: its product
        return logits if raw else logits.float()

    def _head_weight(self, rows: int) -> Weight:
        """The head for a product of `rows` rows: the int8 copy (--quant) up to HEAD8_MAX_ROWS."""
        if self.w.head8 is not None and rows <= HEAD8_MAX_ROWS:
            return self.w.head8
        return self.w.head


def _rows(t: torch.Tensor, sidx: torch.Tensor | None) -> torch.Tensor:
    """Rows sidx of a (B, C) shift tensor (all rows when None)."""
    return t if sidx is None else t.index_select(0, sidx)


def _put_rows(t: torch.Tensor, sidx: torch.Tensor | None, src: torch.Tensor) -> None:
    if sidx is None:
        t.copy_(src)
    else:
        t.index_copy_(0, sidx, src.to(t.dtype))
