"""Pre-quantized checkpoints (`rwkv-server quantize`, server.model.qfile): the file a later load
reads instead of quantizing holds the same codes and computes the same function as quantizing at
load; a mismatched --quant, a file quantized twice and a damaged file each get one clear error."""

from __future__ import annotations

import httpx
import pytest
import torch
from test_cli_checks import run_cli
from util_server import running_server

from server.model import load_model, qfile
from server.model.checkpoint import CheckpointError
from server.model.qlinear import QWeight
from server.model.quant import LAYER_LINEARS
from server.model.synthetic import save_synthetic


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("qfile") / "tiny.pth"
    save_synthetic("tiny:5", str(path))
    return str(path)


@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_a_quantized_file_loads_as_quantizing_at_load_does(src, tmp_path, mode):
    out = tmp_path / f"tiny-{mode}.pth"
    r = run_cli("quantize", src, str(out), "--quant", mode, "--dtype", "fp32", "--device", "cpu")
    assert r.returncode == 0 and f"wrote {out}" in r.stdout, r.stderr
    pre = load_model(str(out))  # --quant none: the file's own mode
    ref = load_model(src, quant=mode)
    assert pre.quant == mode and pre.synthetic  # the synthetic mark travels with the file
    for lp, lr in zip(pre.w.layers, ref.w.layers):
        for name in LAYER_LINEARS:
            a, b = getattr(lp, name), getattr(lr, name)
            assert isinstance(a, QWeight) and torch.equal(a.q.view(torch.uint8), b.q.view(torch.uint8))
            assert torch.equal(a.scale, b.scale) and a.dtype == b.dtype == torch.float32
    assert torch.equal(pre.w.head, ref.w.head) and torch.equal(pre.w.emb, ref.w.emb)
    toks = [[1, 2, 3, 4, 5], [7, 8]]
    sp, sr = pre.zero_state(2), ref.zero_state(2)
    assert torch.equal(pre.forward(toks, sp), ref.forward(toks, sr))
    assert torch.equal(pre.decode(torch.tensor([3, 4]), sp), ref.decode(torch.tensor([3, 4]), sr))
    assert load_model(str(out), quant=mode).quant == mode  # the same mode asked for: fine


def test_mismatches_and_damage_are_named(src, tmp_path):
    out = tmp_path / "tiny-int8.pth"
    assert run_cli("quantize", src, str(out), "--quant", "int8", "--device", "cpu").returncode == 0
    with pytest.raises(CheckpointError, match=r"holds int8 weights .* cannot be loaded with --quant fp8"):
        load_model(str(out), quant="fp8")
    again = run_cli("quantize", str(out), str(tmp_path / "twice.pth"), "--quant", "fp8", "--device", "cpu")
    assert again.returncode == 2 and "is already quantized (int8)" in again.stderr
    assert not (tmp_path / "twice.pth").exists()
    same = run_cli("quantize", src, src, "--quant", "int8", "--device", "cpu")
    assert same.returncode == 2 and "is the checkpoint being read" in same.stderr
    sd = torch.load(out, weights_only=True)
    key = "blocks.1.ffn.value.weight"
    torch.save({k: v for k, v in sd.items() if k != key + qfile.SCALES}, tmp_path / "no-scale.pth")
    with pytest.raises(CheckpointError, match=r"blocks\.1\.ffn\.value\.weight\.scale': missing"):
        load_model(str(tmp_path / "no-scale.pth"))
    torch.save({**sd, key + qfile.CODES: sd[key + qfile.CODES].float()}, tmp_path / "bad-codes.pth")
    with pytest.raises(CheckpointError, match=r"ffn\.value\.weight\.q': torch\.float32"):
        load_model(str(tmp_path / "bad-codes.pth"))
    sixteen = {k: v for k, v in sd.items() if not k.startswith(key)}
    sixteen[key] = torch.zeros(sd[key + qfile.CODES].shape, dtype=torch.bfloat16)  # one linear left 16-bit
    torch.save(sixteen, tmp_path / "mixed.pth")
    with pytest.raises(CheckpointError, match="not those `--quant` quantizes"):
        load_model(str(tmp_path / "mixed.pth"))


def test_the_server_says_it_serves_the_files_weights(src, tmp_path):
    out = tmp_path / "tiny-int8.pth"
    assert run_cli("quantize", src, str(out), "--quant", "int8", "--device", "cpu").returncode == 0
    with running_server(tmp_path, model=str(out)) as srv:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "ignore_eos": True},
                       timeout=60)  # (sampled: an end-of-text could end it early)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        log = srv.log_path.read_text()
    assert "pre-quantized int8 weights (12 linears): no quantization at load" in log
    assert "weights    int8: the layers' r/k/v/o and FFN linears (per-channel scales, as the checkpoint holds them)" in log


def test_a_write_that_fails_leaves_no_partial_file(src, tmp_path, monkeypatch):
    out = tmp_path / "q.pth"

    def full_disk(obj, path):  # writes a piece, then the disk is full
        with open(path, "wb") as f:
            f.write(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(qfile.torch, "save", full_disk)
    with pytest.raises(OSError, match="No space"):
        qfile.save_quantized(str(src), str(out), "int8", torch.float32)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_synthetic_write_that_fails_leaves_no_partial_file(tmp_path, monkeypatch):
    """`synth` writes through a partial file too (it wrote straight to its output: a full disk
    left a truncated checkpoint under the name asked for)."""
    out = tmp_path / "s.pth"

    def full_disk(obj, path):
        with open(path, "wb") as f:
            f.write(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(OSError, match="No space"):
        save_synthetic("tiny", str(out))
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    monkeypatch.undo()
    save_synthetic("tiny", str(out))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.pth"] and load_model(str(out)).shape.n_layer > 0
