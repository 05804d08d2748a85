"""The trained byte-level RWKV-7 kept as test data (test/data/train_bytes.py): the server's model
computes what the independent training forward computes, and it is a trained model (peaked,
low-loss predictions on held-out text), so the quality figures measured on it mean something."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

DATA = Path(__file__).resolve().parent / "data"
sys.path.insert(0, str(DATA))

import train_bytes  # noqa: E402

from server.model import load_model  # noqa: E402

CKPT = train_bytes.DEFAULT_OUT


@pytest.fixture(scope="module")
def model():
    return load_model(str(CKPT), "cpu", torch.float32, torch.float32, kernels="torch")


def test_checkpoint_is_small_and_byte_level(model):
    assert CKPT.stat().st_size <= 20 * 2**20
    assert model.shape.vocab_size == 256 and model.shape.n_layer == 4


def test_server_model_equals_the_training_forward(model):
    """Logits at every position of a held-out stretch: the server's prefill (one forward per
    chunk) and decode paths against the autograd formulation the weights were trained with."""
    ids = train_bytes.held_out(97)
    sd = {k: v.float() for k, v in torch.load(CKPT, map_location="cpu", weights_only=True).items()}
    with torch.no_grad():
        ref = train_bytes.forward(sd, torch.tensor([ids]), model.shape.n_layer, model.shape.n_head)[0]  # (T, V)
        state = model.zero_state(1)
        dec = torch.cat([model.decode(torch.tensor([t]), state) for t in ids])  # (T, V)
        state = model.zero_state(1)
        pre = torch.cat([model.forward([ids[c : c + 1]], state) for c in range(0, 48)]
                        + [model.forward([ids[48:]], state)])  # (49, V): positions 0..47, then 96
    scale = ref.abs().max()
    assert (dec - ref).abs().max() <= 1e-4 * scale
    assert (pre[:48] - ref[:48]).abs().max() <= 1e-4 * scale
    assert (pre[48] - ref[-1]).abs().max() <= 1e-4 * scale


def test_it_is_trained(model):
    """Held-out loss far below a uniform byte's ln 256 = 5.55 nats, and confident predictions
    (what the random synthetic weights never give)."""
    ids = train_bytes.held_out(400)
    state = model.zero_state(1)
    with torch.no_grad():
        logits = torch.cat([model.decode(torch.tensor([t]), state) for t in ids[:-1]])  # (T, V)
    loss = F.cross_entropy(logits, torch.tensor(ids[1:])).item()
    p1 = torch.softmax(logits, -1).max(-1).values.mean().item()
    assert loss < 2.0, loss
    assert p1 > 0.4, p1
