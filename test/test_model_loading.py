"""Checkpoint loading errors, synthetic checkpoints (format, determinism, scales), State helpers."""

from __future__ import annotations

import pytest
import torch

from server.model import CheckpointError, ModelShape, State, load_model
from server.model.checkpoint import SYNTHETIC_MARK, expected_shapes, read_checkpoint, validate
from server.model.synthetic import PRESETS, parse_spec, save_synthetic, synthetic_state_dict


@pytest.fixture(scope="module")
def tiny_pth(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "tiny.pth"
    save_synthetic("synthetic:tiny:3", str(path))  # bf16, like the released files
    return path


def test_saved_file_has_the_official_keys(tiny_pth):
    sd = torch.load(tiny_pth, map_location="cpu", weights_only=True)
    shape = PRESETS["tiny"]
    assert sd.pop(SYNTHETIC_MARK).tolist() == [3]  # the seed: loaders recognise random weights
    assert set(sd) == set(expected_shapes(shape))
    assert "blocks.0.att.v0" not in sd and "blocks.1.att.v0" in sd
    assert list(sd)[:3] == ["emb.weight", "blocks.0.ln0.weight", "blocks.0.ln0.bias"]
    att1 = [k[len("blocks.1.att.") :] for k in sd if k.startswith("blocks.1.att.")]
    assert att1[:17] == "x_r x_w x_k x_v x_a x_g w0 w1 w2 a0 a1 a2 v0 v1 v2 g1 g2".split()
    assert list(sd)[-3:] == ["ln_out.weight", "ln_out.bias", "head.weight"]
    assert sd["blocks.0.att.x_r"].shape == (1, 1, 128) and sd["blocks.0.att.r_k"].shape == (2, 64)
    assert sd["blocks.1.att.v1"].shape == (128, 32) and sd["head.weight"].shape == (65536, 128)
    assert all(t.dtype == torch.bfloat16 for t in sd.values())
    assert validate(sd) == shape


def test_loaded_file_equals_synthetic_spec(tiny_pth):
    a = load_model(str(tiny_pth))
    b = load_model("synthetic:tiny:3", dtype=torch.bfloat16)
    assert a.shape == b.shape == PRESETS["tiny"] and a.name == "tiny.pth"
    la = a.forward([[1, 2, 3]], a.zero_state(1))
    lb = b.forward([[1, 2, 3]], b.zero_state(1)).float()
    assert (la - lb).abs().max() / la.abs().max() < 0.05  # fp32 compute vs bf16 compute


def _save(sd, path):
    torch.save(sd, path)
    return str(path)


def test_a_synthetic_file_is_recognised_and_an_official_one_is_not(tiny_pth, tmp_path):
    assert load_model(str(tiny_pth)).synthetic
    sd = torch.load(tiny_pth, map_location="cpu", weights_only=True)
    del sd[SYNTHETIC_MARK]
    torch.save(sd, tmp_path / "plain.pth")
    assert not load_model(str(tmp_path / "plain.pth")).synthetic
    assert load_model("synthetic:tiny").synthetic


def test_missing_key_is_named(tmp_path):
    sd = synthetic_state_dict("synthetic:tiny")
    del sd["blocks.1.att.v1"]
    with pytest.raises(CheckpointError, match=r"missing key 'blocks\.1\.att\.v1'"):
        load_model(_save(sd, tmp_path / "m.pth"))
    sd = synthetic_state_dict("synthetic:tiny")
    del sd["head.weight"]
    with pytest.raises(CheckpointError, match="head.weight"):
        load_model(_save(sd, tmp_path / "m.pth"))


def test_misshapen_key_is_named(tmp_path):
    sd = synthetic_state_dict("synthetic:tiny")
    sd["blocks.1.att.key.weight"] = torch.zeros(128, 64)
    with pytest.raises(CheckpointError, match=r"misshapen key 'blocks\.1\.att\.key\.weight'"):
        load_model(_save(sd, tmp_path / "m.pth"))
    sd = synthetic_state_dict("synthetic:tiny")
    sd["blocks.0.att.x_k"] = torch.zeros(1, 2, 128)
    with pytest.raises(CheckpointError, match="blocks.0.att.x_k"):
        load_model(_save(sd, tmp_path / "m.pth"))


def test_other_formats_refused(tmp_path):
    p = tmp_path / "model.safetensors"
    p.write_bytes(b"\0" * 16)
    with pytest.raises(CheckpointError, match=r"only official RWKV-7 \.pth"):
        load_model(str(p))
    with pytest.raises(FileNotFoundError):
        load_model(str(tmp_path / "absent.pth"))
    bad = tmp_path / "junk.pth"
    bad.write_bytes(b"not a zip")
    with pytest.raises(CheckpointError, match=r"cannot read .* as a torch checkpoint .*damaged, truncated"):
        load_model(str(bad))
    (tmp_path / "empty.pth").write_bytes(b"")
    with pytest.raises(CheckpointError, match="is empty"):
        load_model(str(tmp_path / "empty.pth"))
    with pytest.raises(CheckpointError, match="not a state dict"):
        load_model(_save([1, 2], tmp_path / "list.pth"))


def test_a_checkpoint_in_torchs_legacy_format_loads(tmp_path):
    """torch.save(..., _use_new_zipfile_serialization=False) files (older tools write them) load
    without mmap, to the same model."""
    sd = synthetic_state_dict("synthetic:tiny")
    torch.save(sd, tmp_path / "new.pth")
    torch.save(sd, tmp_path / "old.pth", _use_new_zipfile_serialization=False)
    new, old = read_checkpoint(str(tmp_path / "new.pth")), read_checkpoint(str(tmp_path / "old.pth"))
    assert new.keys() == old.keys() and all(torch.equal(new[k], old[k]) for k in new)
    assert load_model(str(tmp_path / "old.pth")).shape == load_model(str(tmp_path / "new.pth")).shape


def test_layer0_v_keys_are_accepted_and_ignored(tmp_path):
    sd = synthetic_state_dict("synthetic:tiny")
    ref = load_model("synthetic:tiny")
    sd["blocks.0.att.v0"] = torch.zeros(1, 1, 128)
    sd["blocks.0.att.v1"] = torch.zeros(128, 32)
    sd["blocks.0.att.v2"] = torch.zeros(32, 128)
    m = load_model(_save(sd, tmp_path / "m.pth"))
    assert torch.equal(m.forward([[5, 6]], m.zero_state(1)), ref.forward([[5, 6]], ref.zero_state(1)))


def test_synthetic_specs_and_determinism():
    assert parse_spec("synthetic:0.1b")[1] == 0 and parse_spec("synthetic:7.2b:9")[1] == 9
    shapes = {k: (v.n_layer, v.n_embd, v.d_decay, v.d_aaa, v.d_mv, v.d_gate) for k, v in PRESETS.items()}
    assert shapes["0.1b"] == (12, 768, 64, 64, 32, 128)
    assert shapes["1.5b"] == (24, 2048, 96, 96, 64, 256)
    assert shapes["7.2b"][:2] == (32, 4096) and PRESETS["2.9b"].ffn_dim == 4 * 2560
    custom = parse_spec("synthetic:L3-C256-V1024:4")
    assert (custom[0].n_layer, custom[0].n_embd, custom[0].vocab_size, custom[1]) == (3, 256, 1024, 4)
    for bad in ("synthetic:huge", "synthetic:tiny:x", "tiny", "synthetic:L0-C64", "synthetic:L1-C0", "synthetic:L1-C64-V1"):
        with pytest.raises(ValueError):
            parse_spec(bad)
    a, b = synthetic_state_dict("synthetic:tiny:1"), synthetic_state_dict("synthetic:tiny:1")
    c = synthetic_state_dict("synthetic:tiny:2")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["blocks.1.att.key.weight"], c["blocks.1.att.key.weight"])
    h = synthetic_state_dict("synthetic:tiny:1", dtype=torch.float16)
    assert h["head.weight"].dtype == torch.float16 and torch.equal(h["head.weight"], a["head.weight"].half())


def test_deep_synthetic_model_stays_bounded():
    """32 layers (the 2.9b/7.2b depth) at a small width: activations far from fp16 overflow."""
    m = load_model("synthetic:L32-C128-V512:0", chunk_len=64)
    peak = {"x": 0.0, "y": 0.0}
    wkv_chunk = m.ops.wkv_chunk

    def spy(state, *args):
        y = wkv_chunk(state, *args)
        peak["y"] = max(peak["y"], y.abs().max().item())
        return y

    m.ops.wkv_chunk = spy
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 512, (48,), generator=g).tolist(), [7] * 48]
    state = m.zero_state(2)
    logits = m.forward(prompts, state)
    for _ in range(4):
        logits = m.decode(logits.argmax(-1), state)
    assert torch.isfinite(logits).all() and 0.3 < logits.std() < 20
    assert peak["y"] < 1e4 and state.wkv.abs().max() < 1e4
    assert state.att_shift.abs().max() < 100 and state.ffn_shift.abs().max() < 100


@pytest.mark.slow
def test_2p9b_width_layers_stay_bounded():
    """Two layers at the 2.9b width (C=2560) in bf16 compute (costly: marked slow)."""
    m = load_model("synthetic:L2-C2560-V256:0", dtype=torch.bfloat16)
    state = m.zero_state(1)
    logits = m.forward([[1, 2, 3, 4] * 8], state)
    assert torch.isfinite(logits).all() and state.wkv.abs().max() < 1e4


def test_state_helpers():
    shape = ModelShape(2, 128, 2, 64, 100, 512, 32, 32, 32, 32)
    st = State.zeros(shape, 4)
    for i, t in enumerate(st.tensors()):
        t.copy_(torch.randn(t.shape))
    g = st.gather([3, 1])
    assert torch.equal(g.wkv[:, 0], st.wkv[:, 3]) and torch.equal(g.att_shift[:, 1], st.att_shift[:, 1])
    g.wkv.add_(1)  # a copy: st is untouched
    assert not torch.equal(g.wkv[:, 0], st.wkv[:, 3])
    st.scatter(g, [0, 2])
    assert torch.equal(st.wkv[:, 0], g.wkv[:, 0]) and torch.equal(st.ffn_shift[:, 2], g.ffn_shift[:, 1])
    st.copy_slot(1, 0)
    assert torch.equal(st.wkv[:, 1], st.wkv[:, 0])
    st.zero_slots([1])
    assert st.wkv[:, 1].abs().max() == 0 and st.att_shift[:, 1].abs().max() == 0
    v = st.view(2, 4)
    v.wkv.zero_()
    assert st.wkv[:, 2:].abs().max() == 0 and v.batch_size == 2
    assert st.nbytes() == 4 * shape.state_bytes(torch.float32, torch.float32)
    assert st.clone().checksum() == st.checksum()
