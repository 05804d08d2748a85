"""Logprobs of a step's rows on the device (torch): log_softmax of the raw logits, the
target's value and the top k, one small copy to the host with the step's token ids.

The runner calls `select` on the logits before any grammar mask changes them (a copy of the
rows that ask), `finish` after the sampling (the sampled tokens are the targets of generated
tokens), and `values` once the step's copy to the host completed (runner.finish).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .plan import SAMPLED
from .types import MAX_LOGPROBS, TokenLogprob


@dataclass
class Pending:
    """A step's logprobs on their way to the host: per entry (row, k, target) of the plan,
    [token, logprob, K top ids, K top logprobs] in `out` (a pinned host buffer on CUDA)."""

    entries: list[tuple[int, int, int]]
    x: torch.Tensor  # (R, V) fp32: the rows' raw logits (before any mask)
    lse: torch.Tensor  # (R, 1)
    out: torch.Tensor  # (R, 2 + 2K) on the host once the step's copy completed
    K: int


class LogprobRows:
    def __init__(self, max_batch: int, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self._host = torch.zeros(max_batch, 2 + 2 * MAX_LOGPROBS, pin_memory=self.cuda)  # (M, 2 + 2K) fp32
        self._rows: tuple[list, torch.Tensor, torch.Tensor] | None = None  # entries -> (rows, targets) on device

    def select(self, entries: list[tuple[int, int, int]], logits: torch.Tensor):
        """The entries' rows of the raw logits (a copy: masks change `logits` in place later)."""
        if self._rows is None or self._rows[0] is not entries:  # a continuation plan keeps the list
            rows = torch.tensor([e[0] for e in entries], dtype=torch.long).to(self.device, non_blocking=True)
            tgt = torch.tensor([e[2] for e in entries], dtype=torch.long).to(self.device, non_blocking=True)
            self._rows = (entries, rows, tgt)
        _, rows, tgt = self._rows
        return entries, logits.index_select(0, rows).float(), rows, tgt  # (R, V)

    def finish(self, sel, tok: torch.Tensor) -> Pending:
        """log_softmax of the selected rows: the target's (the sampled token or a prompt token)
        and the top K; enqueued to the host (before the step's id copy and its event)."""
        entries, x, rows, tgt = sel
        K = max(e[1] for e in entries)
        lse = torch.logsumexp(x, dim=-1, keepdim=True)  # (R, 1)
        t = torch.where(tgt >= 0, tgt, tok.index_select(0, rows).clamp(min=0))  # (R,)
        parts = [t[:, None].float(), x.gather(1, t[:, None]) - lse]
        if K:
            v, i = x.topk(K, dim=-1)  # (R, K)
            parts += [i.float(), v - lse]
        out = torch.cat(parts, dim=1)  # (R, 2 + 2K)
        if self.cuda:
            host = self._host[: len(entries), : out.shape[1]]
            host.copy_(out, non_blocking=True)
            out = host
        return Pending(entries, x, lse, out, K)

    @staticmethod
    def values(lp: Pending, host_ids: list[int] | None) -> list[TokenLogprob]:
        """The entries' TokenLogprobs (the step's copy completed). host_ids: the step's ids when
        overflow rows were re-sampled on the host (their value is recomputed)."""
        res = []
        for j, ((row, k, target), r) in enumerate(zip(lp.entries, lp.out.tolist())):
            tok, own = int(r[0]), r[1]
            if target == SAMPLED and host_ids is not None and host_ids[row] != tok:
                tok = host_ids[row]  # an overflow row re-sampled on the host
                own = (lp.x[j, tok] - lp.lse[j, 0]).item()
            top = tuple((int(i), v) for i, v in zip(r[2 : 2 + k], r[2 + lp.K : 2 + lp.K + k]))
            res.append(TokenLogprob(tok, own, top))
        return res
