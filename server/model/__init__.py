"""RWKV-7 model: checkpoint loading, synthetic checkpoints, forward/decode, state layout.

Usage:

    from server.model import load_model
    model = load_model("synthetic:tiny", device="cpu", dtype=torch.float32)
    state = model.zero_state(batch=4)
    logits = model.forward([[1, 2, 3], [7], [9, 9], [5, 6, 7, 8]], state)  # (4, 65536) fp32
"""

from server.model.checkpoint import CheckpointError
from server.model.loader import load_model
from server.model.rwkv7 import RWKV7
from server.model.state import ModelShape, State

__all__ = ["RWKV7", "CheckpointError", "ModelShape", "State", "load_model"]
