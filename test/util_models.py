"""Checkpoints built for tests: synthetic:tiny rewired so that its greedy output is a fixed walk of
tokens, whatever the prompt. The blocks add nothing (their output projections are zero), so the
head reads the embedding of the last token alone: each token of the walk has a direction of its
own, every other token shares one, and the head maps each direction to its successor."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from server.model.synthetic import synthetic_state_dict

OTHERS = 0
"""The direction of every token outside the walk (its successor: the walk's first token)."""


def walk_checkpoint(path, walk: Sequence[int]) -> str:
    """A checkpoint at `path` whose greedy successor of any token outside `walk` is walk[0], of
    walk[i] walk[i + 1], and of the walk's last token that token itself (a walk that ends with EOS,
    0, then stops at once after every EOS). The walk's tokens are distinct, at most 127."""
    assert len(set(walk)) == len(walk) and 0 < len(walk) < 128, walk
    sd = synthetic_state_dict("synthetic:tiny")
    emb = torch.zeros_like(sd["emb.weight"])
    emb[:, OTHERS] = 1.0
    head = torch.zeros_like(sd["head.weight"])
    head[walk[0], OTHERS] = 10.0
    for d, t in enumerate(walk, start=1):
        emb[t] = 0.0
        emb[t, d] = 1.0
        head[walk[min(d, len(walk) - 1)], d] = 10.0
    sd["emb.weight"], sd["head.weight"] = emb, head
    silence_blocks(sd)
    torch.save(sd, path)
    return str(path)


def silence_blocks(sd: dict[str, torch.Tensor]) -> None:
    """The blocks of a state dict add nothing to the residual (zero output projections), and ln0
    and ln_out have weight 1 and bias 0: the head reads the normalized embedding of the last
    token alone."""
    for k in sd:
        if k.endswith(("att.output.weight", "ffn.value.weight")):
            sd[k] = torch.zeros_like(sd[k])
        elif k.endswith(("ln0.weight", "ln_out.weight")):
            sd[k] = torch.ones_like(sd[k])
        elif k.endswith(("ln0.bias", "ln_out.bias")):
            sd[k] = torch.zeros_like(sd[k])
