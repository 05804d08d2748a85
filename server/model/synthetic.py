"""Synthetic RWKV-7 checkpoints: random weights with realistic scales in the official format.

Spec: `synthetic:<preset>[:seed]` with presets tiny, 0.1b, 0.4b, 1.5b, 2.9b, 7.2b, or a custom
shape `L<layers>-C<embd>[-V<vocab>]` (e.g. `synthetic:L3-C256-V1024:7`). Every tensor has its
own generator seeded from (seed, key), made on the target device; values are drawn in fp32 one
tensor at a time and cast, so a model in bf16 is the fp32 one rounded. Never judge quality on
these: the weights are random, only their scales are realistic (states and activations stay
bounded through 32 layers, far from fp16 overflow).
"""

from __future__ import annotations

import dataclasses
import math
import re
import zlib

import torch

from server.model.checkpoint import SYNTHETIC_MARK, expected_shapes, save_whole
from server.model.state import ModelShape

VOCAB = 65536
MAX_SEED = 2**63 - 1
"""The largest seed: a file's SYNTHETIC_MARK holds it as an int64 (the API's seed bound too)."""


def _lora(C: int, k: float, p: float) -> int:
    # the official training code's suggested low-rank widths
    return max(32, round(k * C**p / 32) * 32)


def make_shape(n_layer: int, n_embd: int, vocab: int = VOCAB, head_size: int = 64) -> ModelShape:
    if n_layer < 1 or n_embd < head_size or vocab < 2:
        raise ValueError(f"a model needs a layer, n_embd >= {head_size} and 2 tokens (L{n_layer}-C{n_embd}-V{vocab})")
    if n_embd % head_size:
        raise ValueError(f"n_embd={n_embd} is not a multiple of head_size={head_size}")
    C = n_embd
    return ModelShape(
        n_layer=n_layer, n_embd=C, n_head=C // head_size, head_size=head_size, vocab_size=vocab,
        ffn_dim=4 * C, d_decay=_lora(C, 1.8, 0.5), d_aaa=_lora(C, 1.8, 0.5),
        d_mv=_lora(C, 1.3, 0.5), d_gate=128 if C == 1024 else _lora(C, 0.6, 0.8),
    )  # fmt: skip


# (L, C) as released; the widths (w, a, v, g) come out as 0.1b 64/64/32/128, 0.4b 64/64/32/128,
# 1.5b 96/96/64/256, 2.9b 96/96/64/320, 7.2b 128/128/96/480 (tiny: 32 each).
PRESETS: dict[str, ModelShape] = {
    name: make_shape(L, C)
    for name, (L, C) in {
        "tiny": (2, 128), "0.1b": (12, 768), "0.4b": (24, 1024),
        "1.5b": (24, 2048), "2.9b": (32, 2560), "7.2b": (32, 4096),
    }.items()
}  # fmt: skip


def parse_spec(spec: str) -> tuple[ModelShape, int]:
    """'synthetic:<preset>[:seed]' -> (shape, seed)."""
    parts = spec.split(":")
    if parts[0] != "synthetic" or len(parts) not in (2, 3):
        raise ValueError(f"bad synthetic spec {spec!r}: expected 'synthetic:<preset>[:seed]'")
    name = parts[1].lower()
    seed = 0
    if len(parts) == 3:
        try:
            seed = int(parts[2])
        except ValueError:
            raise ValueError(f"bad seed {parts[2]!r} in {spec!r}: expected an integer") from None
        if not 0 <= seed <= MAX_SEED:
            raise ValueError(f"bad seed {parts[2]!r} in {spec!r}: a seed is 0 to {MAX_SEED:,}")
    if name in PRESETS:
        return PRESETS[name], seed
    m = re.fullmatch(r"l(\d+)-c(\d+)(?:-v(\d+))?", name)
    if m:
        return make_shape(int(m[1]), int(m[2]), int(m[3] or VOCAB)), seed
    raise ValueError(f"unknown synthetic preset {parts[1]!r}: use one of {', '.join(PRESETS)} or L<n>-C<n>[-V<n>]")


def parameters(shape: ModelShape) -> int:
    """The number of values in a checkpoint of `shape` (counted per layer: L may be huge)."""
    count = lambda s: sum(math.prod(t) for t in expected_shapes(s).values())
    one = count(dataclasses.replace(shape, n_layer=1))
    return one + (shape.n_layer - 1) * (count(dataclasses.replace(shape, n_layer=2)) - one)


class _Gen:
    """Draws fp32 tensors on `device` with a generator seeded per key, casts to `dtype`."""

    def __init__(self, seed: int, device, dtype: torch.dtype):
        self.seed, self.device, self.dtype = seed, torch.device(device), dtype
        self.g = torch.Generator(device=self.device)

    def _seed(self, key: str) -> None:
        self.g.manual_seed((self.seed * 1_000_003 + zlib.crc32(key.encode())) % (2**63))

    def normal(self, key: str, shape, std: float = 1.0, mean=0.0) -> torch.Tensor:
        self._seed(key)
        t = torch.randn(shape, generator=self.g, device=self.device, dtype=torch.float32)
        return (t.mul_(std).add_(mean)).to(self.dtype)


def synthetic_state_dict(
    spec: str | tuple[ModelShape, int], device="cpu", dtype=torch.float32
) -> dict[str, torch.Tensor]:
    """An official-format state dict (key order and shapes as the released .pth files)."""
    s, seed = parse_spec(spec) if isinstance(spec, str) else spec
    gen = _Gen(seed, device, dtype)
    C, L, D = s.n_embd, s.n_layer, gen.device
    vec = lambda t: t.reshape(1, 1, C)  # the official shape of per-channel vectors
    ddd = torch.arange(C, device=D, dtype=torch.float32) / C  # (C,)
    sd: dict[str, torch.Tensor] = {"emb.weight": gen.normal("emb.weight", (s.vocab_size, C))}
    for i in range(L):
        p, a = f"blocks.{i}.", f"blocks.{i}.att."
        r01, r1a0 = (i / (L - 1) if L > 1 else 0.0), 1.0 - i / L
        norm = ("ln0", "ln1", "ln2") if i == 0 else ("ln1", "ln2")
        for n in norm:
            sd[p + n + ".weight"] = gen.normal(p + n + ".weight", (C,), 0.1, 1.0)
            sd[p + n + ".bias"] = gen.normal(p + n + ".bias", (C,), 0.05)
        pw = {"x_r": 0.2, "x_w": 0.9, "x_k": 0.9, "x_v": 0.4, "x_a": 0.9, "x_g": 0.2}
        for n, e in pw.items():  # token-shift mix: the official init curve plus noise
            base = 1.0 - ddd.pow(e * r1a0)
            sd[a + n] = vec((base + gen.normal(a + n, (C,), 0.05).float()).to(dtype))
        speed = -7.0 + 5.0 * torch.linspace(0, 1, C, device=D).pow(0.85 + r01**0.5) + 0.5  # [-6.5, -1.5]
        sd[a + "w0"] = vec((speed + gen.normal(a + "w0", (C,), 0.3).float()).to(dtype))
        lora = (
            [("w", s.d_decay, None), ("a", s.d_aaa, 0.0)]
            + ([("v", s.d_mv, 0.5)] if i else [])
            + [("g", s.d_gate, None)]
        )
        for n, d, mean0 in lora:  # a = sigmoid(a0 + ...) ~ 0.5; v-mix = sigmoid(v0 + ...) ~ 0.6
            if mean0 is not None:
                sd[a + n + "0"] = vec(gen.normal(a + n + "0", (C,), 0.5, mean0))
            sd[a + n + "1"] = gen.normal(a + n + "1", (C, d), 1.0 / math.sqrt(C))
            sd[a + n + "2"] = gen.normal(a + n + "2", (d, C), 1.0 / math.sqrt(d))
        sd[a + "k_k"] = vec(gen.normal(a + "k_k", (C,), 0.1, 0.85))
        sd[a + "k_a"] = vec(gen.normal(a + "k_a", (C,), 0.1, 1.0))
        sd[a + "r_k"] = gen.normal(a + "r_k", (s.n_head, s.head_size), 0.05)
        for n, std in (("receptance", 1.0), ("key", 0.5), ("value", 1.0), ("output", 1.0)):
            sd[a + n + ".weight"] = gen.normal(a + n + ".weight", (C, C), std / math.sqrt(C))
        sd[a + "ln_x.weight"] = gen.normal(a + "ln_x.weight", (C,), 0.1, 1.0)
        sd[a + "ln_x.bias"] = gen.normal(a + "ln_x.bias", (C,), 0.02)
        f = p + "ffn."
        sd[f + "x_k"] = vec((1.0 - ddd.pow(r1a0**4) + gen.normal(f + "x_k", (C,), 0.05).float()).to(dtype))
        sd[f + "key.weight"] = gen.normal(f + "key.weight", (s.ffn_dim, C), 1.0 / math.sqrt(C))
        sd[f + "value.weight"] = gen.normal(f + "value.weight", (C, s.ffn_dim), 0.5 / math.sqrt(s.ffn_dim))
    sd["ln_out.weight"] = gen.normal("ln_out.weight", (C,), 0.1, 1.0)
    sd["ln_out.bias"] = gen.normal("ln_out.bias", (C,), 0.02)
    sd["head.weight"] = gen.normal("head.weight", (s.vocab_size, C), 2.0 / math.sqrt(C))
    return sd


def save_synthetic(preset_spec: str, path: str, dtype: torch.dtype = torch.bfloat16) -> ModelShape:
    """Write a synthetic model as an official-format .pth (loadable here and by the rwkv package)."""
    spec = preset_spec if preset_spec.startswith("synthetic:") else f"synthetic:{preset_spec}"
    shape, seed = parse_spec(spec)
    sd = synthetic_state_dict((shape, seed), device="cpu", dtype=dtype)
    sd[SYNTHETIC_MARK] = torch.tensor([seed], dtype=torch.int64)  # loaders warn: random weights
    save_whole(sd, path)
    return shape
