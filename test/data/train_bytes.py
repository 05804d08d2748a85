"""Train a small byte-level RWKV-7 on text that ships with Python (its standard library's own
sources), so the quality harness (test/bench/quality.py) has a model with trained, peaked
next-token distributions besides the random synthetic ones. The result is an official-format
.pth (bf16, vocabulary = the 256 byte values) that server.model.load_model reads.

    python test/data/train_bytes.py                 # ~20 min on 2 CPU cores; a GPU is faster
    python test/data/train_bytes.py --steps 50 --out /tmp/x.pth   # a quick trial

The training forward below is the RWKV-7 ("x070") recurrence written for autograd: whole
sequences, the WKV state stepped token by token. After training, the saved weights are loaded
with the server's own loader and the held-out loss is computed both ways: they must agree
(--check-tol), so what the harness measures is the model that was trained.
"""

from __future__ import annotations

import argparse
import math
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from server.model.synthetic import make_shape, synthetic_state_dict  # noqa: E402

DEFAULT_OUT = ROOT / "test" / "data" / "rwkv7-bytes-L4-C256.pth"
HELD_OUT = 65536
"""Bytes at the corpus' end kept out of training (the quality harness reads from them)."""


def corpus(max_bytes: int = 6 * 2**20) -> bytes:
    """The standard library's .py files (tests excluded), sorted by path, joined by blank lines,
    up to max_bytes. The same Python version gives the same bytes."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    out, n = [], 0
    for p in sorted(lib.rglob("*.py")):
        rel = p.relative_to(lib).parts
        if any(part in ("test", "tests", "idlelib", "site-packages") for part in rel):
            continue
        try:
            data = p.read_bytes()
        except OSError:
            continue
        out.append(data)
        n += len(data) + 2
        if n >= max_bytes:
            break
    return b"\n\n".join(out)[:max_bytes]


def held_out(n: int) -> list[int]:
    """n byte ids from the held-out end of the corpus."""
    text = corpus()
    return list(text[-HELD_OUT:][:n])


# --- the training forward (official key names; shapes as in the released files) ------------
def forward(sd: dict[str, torch.Tensor], ids: torch.Tensor, n_layer: int, n_head: int) -> torch.Tensor:
    """ids (B, T) -> logits (B, T, V), from the zero state."""
    x = F.embedding(ids, sd["emb.weight"])  # (B, T, C)
    C = x.shape[-1]
    x = F.layer_norm(x, (C,), sd["blocks.0.ln0.weight"], sd["blocks.0.ln0.bias"])
    v_first = None
    for i in range(n_layer):
        p = f"blocks.{i}."
        xa = F.layer_norm(x, (C,), sd[p + "ln1.weight"], sd[p + "ln1.bias"])
        dx, v_first = time_mix(sd, p + "att.", xa, v_first, i, n_head)
        x = x + dx
        xf = F.layer_norm(x, (C,), sd[p + "ln2.weight"], sd[p + "ln2.bias"])
        xk = xf + (shift(xf) - xf) * sd[p + "ffn.x_k"]
        x = x + F.linear(torch.relu(F.linear(xk, sd[p + "ffn.key.weight"])).square(), sd[p + "ffn.value.weight"])
    x = F.layer_norm(x, (C,), sd["ln_out.weight"], sd["ln_out.bias"])
    return F.linear(x, sd["head.weight"])  # (B, T, V)


def shift(x: torch.Tensor) -> torch.Tensor:
    """(B, T, C): the previous token's input at each position (zeros at t = 0: the zero state)."""
    return F.pad(x, (0, 0, 1, -1))


def time_mix(sd, a: str, x: torch.Tensor, v_first, i: int, H: int):
    B, T, C = x.shape
    N = C // H
    xx = shift(x) - x
    xr, xw, xk, xv, xa, xg = (x + xx * sd[a + n] for n in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g"))
    r = F.linear(xr, sd[a + "receptance.weight"])
    k = F.linear(xk, sd[a + "key.weight"])
    v = F.linear(xv, sd[a + "value.weight"])
    w = F.logsigmoid(sd[a + "w0"] + torch.tanh(xw @ sd[a + "w1"]) @ sd[a + "w2"]) - 0.5  # log-log decay
    aa = torch.sigmoid(sd[a + "a0"] + (xa @ sd[a + "a1"]) @ sd[a + "a2"])
    g = torch.sigmoid(xg @ sd[a + "g1"]) @ sd[a + "g2"]
    kk = F.normalize((k * sd[a + "k_k"]).view(B, T, H, N), dim=-1).view(B, T, C)
    k = k * (1 + (aa - 1) * sd[a + "k_a"])
    if i == 0:
        v_first = v
    else:
        v = torch.lerp(v, v_first, torch.sigmoid(sd[a + "v0"] + (xv @ sd[a + "v1"]) @ sd[a + "v2"]))
    y = wkv(r, w, k, v, -kk, kk * aa, H)  # (B, T, C)
    y = F.group_norm(y.reshape(B * T, C), H, sd[a + "ln_x.weight"], sd[a + "ln_x.bias"], eps=64e-5).view(B, T, C)
    hd = lambda t: t.view(B, T, H, N)  # noqa: E731
    y = y + ((hd(r) * hd(k) * sd[a + "r_k"]).sum(-1, keepdim=True) * hd(v)).view(B, T, C)
    return F.linear(y * g, sd[a + "output.weight"]), v_first


def wkv(r, w, k, v, a, b, H: int) -> torch.Tensor:
    """The WKV recurrence from the zero state, per head: S = S diag(exp(-exp(w))) + (S a) b^T
    + v k^T, y = S r. All (B, T, C) -> (B, T, C)."""
    B, T, C = r.shape
    N = C // H
    col = lambda t: t.view(B, T, H, N, 1)  # noqa: E731
    row = lambda t: t.view(B, T, H, 1, N)  # noqa: E731
    decay = torch.exp(-torch.exp(w.float()))
    rs, as_, vs = col(r.float()), col(a.float()), col(v.float())
    ds, bs, ks = row(decay), row(b.float()), row(k.float())
    s = torch.zeros(B, H, N, N, dtype=torch.float32, device=r.device)  # (B, H, N, N)
    ys = []
    for t in range(T):
        s = s * ds[:, t] + (s @ as_[:, t]) @ bs[:, t] + vs[:, t] @ ks[:, t]
        ys.append(s @ rs[:, t])  # (B, H, N, 1)
    return torch.stack(ys, 1).view(B, T, C).to(r.dtype)


# --- training -------------------------------------------------------------------------------
def train(a: argparse.Namespace) -> dict[str, torch.Tensor]:
    torch.manual_seed(a.seed)
    shape = make_shape(a.layers, a.embd, vocab=256)
    sd = {k: v.float().clone().requires_grad_(True) for k, v in synthetic_state_dict((shape, a.seed)).items()}
    with torch.no_grad():  # start the residual branches small (the official init zeroes them)
        for k, t in sd.items():
            if k.endswith(("att.output.weight", "ffn.value.weight")):
                t.mul_(0.1)
    data = torch.tensor(list(corpus()[:-HELD_OUT]), dtype=torch.long)
    opt = torch.optim.AdamW(list(sd.values()), lr=a.lr, betas=(0.9, 0.99), weight_decay=0.0)
    g = torch.Generator().manual_seed(a.seed)
    t0 = time.time()
    for step in range(a.steps):
        lr = a.lr * min(1.0, (step + 1) / 50) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / a.steps)))
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, len(data) - a.ctx - 1, (a.batch,), generator=g)
        chunk = torch.stack([data[s : s + a.ctx + 1] for s in starts.tolist()])  # (B, T + 1)
        logits = forward(sd, chunk[:, :-1], a.layers, shape.n_head)
        loss = F.cross_entropy(logits.reshape(-1, 256), chunk[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(sd.values()), 1.0)
        opt.step()
        if step % 25 == 0 or step == a.steps - 1:
            print(f"step {step:5d}  loss {loss.item():.4f} nats/byte  lr {lr:.2e}  {time.time() - t0:.0f} s",
                  flush=True)
    return {k: v.detach() for k, v in sd.items()}


def held_out_loss_train_forward(sd: dict[str, torch.Tensor], ids: list[int], layers: int, heads: int) -> float:
    with torch.no_grad():
        x = torch.tensor([ids])
        logits = forward({k: v.float() for k, v in sd.items()}, x[:, :-1], layers, heads)
        return F.cross_entropy(logits[0], x[0, 1:]).item()


def held_out_loss_server(path: Path, ids: list[int]) -> float:
    """The same loss through the server's loader and model (CPU, fp32, pure torch)."""
    from server.model import load_model

    model = load_model(str(path), "cpu", torch.float32, torch.float32, kernels="torch")
    state = model.zero_state(1)
    total = 0.0
    with torch.no_grad():
        for t in range(len(ids) - 1):
            logits = model.decode(torch.tensor([ids[t]]), state)  # (1, V)
            total += F.cross_entropy(logits.float(), torch.tensor([ids[t + 1]])).item()
    return total / (len(ids) - 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--embd", type=int, default=256)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--check-tokens", type=int, default=512)
    ap.add_argument("--check-tol", type=float, default=2e-3, help="held-out loss: training forward vs server")
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    sd = train(a)
    out = {k: v.to(torch.bfloat16).contiguous() for k, v in sd.items()}  # as the released files
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    torch.save(out, a.out)
    ids = held_out(a.check_tokens)
    ours = held_out_loss_train_forward(out, ids, a.layers, a.embd // 64)
    server = held_out_loss_server(Path(a.out), ids)
    print(f"saved {a.out} ({Path(a.out).stat().st_size / 2**20:.1f} MiB); held-out loss over {len(ids) - 1} "
          f"bytes: {ours:.4f} nats/byte (training forward), {server:.4f} (server model)")
    if abs(ours - server) > a.check_tol:
        raise SystemExit(f"the server's model disagrees with the training forward by {abs(ours - server):.4f}")


if __name__ == "__main__":
    main()
