"""A rebuilt state is exact: a task whose state is lost is rebuilt by prefilling its
token history, and prefill and step-by-step decode round differently, so "exact" means: the
rebuilt state's next-token logits are within 1e-4 (relative, fp32 on CPU) of the lost state's,
and greedy continuations agree wherever the top-two logit gap exceeds that. Real engine, tiny
random-weight model, the server's own rebuild path (TaskManager); the logits by the model. The
re-fed history of a rebuild does not count against --max-prompt-tokens; the request's own
prompt still does."""

from __future__ import annotations

import pytest
import torch

from server.config import Settings
from server.engine.types import PromptTooLongError
from server.tasks import TaskManager

GREEDY = {"temperature": 0, "presence_penalty": 0, "repetition_penalty": 0}
REL = 1e-4
PROMPTS = [f"Prompt number {i}: a short story about {w}." for i, w in
           enumerate(["a cat", "the sea", "two robots", "winter", "a lighthouse", "bread", "rain", "a map"])]


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / a.abs().max())


def next_logits(model, state, token: int) -> torch.Tensor:
    st = state.clone()
    return model.forward([[token]], st)[0], st


def gap(logits: torch.Tensor) -> float:
    """The top-two gap relative to the largest logit's magnitude."""
    top = logits.topk(2).values
    return float((top[0] - top[1]) / logits.abs().max())


async def test_a_rebuilt_state_continues_like_the_lost_one(parts, tmp_path):
    model, tok, eng = parts
    tm = TaskManager(eng, tok, Settings(db=str(tmp_path / "x.db"), device="cpu", stats_interval=0), model.shape)
    await tm.start()
    worst, steps, near, flips, decided_flips, smallest = 0.0, 0, 0, 0, 0, 1.0
    try:
        for prompt in PROMPTS:
            t = await tm.wait((await tm.create(prompt, {"max_tokens": 12, **GREEDY}, persistent=True)).id)
            await tm.flush()
            lost = tm.cache.get(t.state_id).clone()  # the state decoding left (now "lost")
            pos = t.state_pos
            assert t.state == "stored" and pos == len(t.tokens) - 1
            await tm.store.states.drop_state(t.stored_id)  # gone from the database and from memory
            tm.cache.discard(t.state_id)
            rebuilds = tm.counters["rebuilds"]
            await tm.wait((await tm.continue_(t.id, {"max_tokens": 0})).id)  # the server rebuilds it
            assert tm.counters["rebuilds"] == rebuilds + 1 and t.state_pos == pos
            assert t.prompt_tokens == pos  # the whole history but the pending token was re-fed
            rebuilt = tm.cache.get(t.state_id)
            # the next token's logits from each state, then greedy steps along the lost one's path
            a, sa = next_logits(model, lost, t.tokens[-1])
            b, sb = next_logits(model, rebuilt, t.tokens[-1])
            worst = max(worst, rel_diff(a, b))
            assert rel_diff(a, b) <= REL, (prompt, rel_diff(a, b))
            for _ in range(32):
                steps += 1
                tie = gap(a) <= REL
                smallest = min(smallest, gap(a))
                near += tie
                if int(a.argmax()) != int(b.argmax()):
                    flips += 1
                    decided_flips += not tie
                nxt = int(a.argmax())  # teacher-forced along the lost state's greedy path
                a, b = model.forward([[nxt]], sa)[0], model.forward([[nxt]], sb)[0]
                assert rel_diff(a, b) <= REL
    finally:
        await tm.close()
    print(f"\nrebuilt vs lost: worst relative logit difference {worst:.2e} (bound {REL:g}); "
          f"{steps} greedy steps: {near} near-ties (top-two gap <= {REL:g} relative), {flips} argmax flips; "
          f"smallest top-two gap {smallest:.2e}")
    assert decided_flips == 0  # a flip only where the model itself is undecided


async def test_the_server_continues_a_rebuilt_task_token_for_token(parts, tmp_path):
    """The same continuation from the state decoding left and from a rebuild, through the
    TaskManager (the prompts here have no near-tie on their path: checked)."""
    model, tok, eng = parts
    tm = TaskManager(eng, tok, Settings(db=str(tmp_path / "y.db"), device="cpu", stats_interval=0), model.shape)
    await tm.start()
    try:
        for prompt in PROMPTS[:4]:
            kept = await tm.wait((await tm.create(prompt, {"max_tokens": 8, **GREEDY}, persistent=True)).id)
            lost = await tm.wait((await tm.create(prompt, {"max_tokens": 8, **GREEDY}, persistent=True)).id)
            await tm.flush()
            assert list(kept.tokens) == list(lost.tokens)
            await tm.store.states.drop_state(lost.stored_id)
            tm.cache.discard(lost.state_id)
            a = await tm.wait((await tm.continue_(kept.id, {"max_tokens": 16})).id)
            b = await tm.wait((await tm.continue_(lost.id, {"max_tokens": 16})).id)
            assert list(a.tokens) == list(b.tokens) and a.out.text == b.out.text, prompt
            assert a.prompt_tokens == 1 and b.prompt_tokens == len(tok.encode(prompt)) + 8
    finally:
        await tm.close()


async def test_a_rebuilt_history_does_not_count_as_the_request_s_prompt(parts, tmp_path):
    # max_prompt_tokens bounds what a request brings. A task whose state was dropped re-feeds its
    # own history; that used to count too, so a task whose history had grown past the bound was
    # refused (413) by every continue, fork and as_template once its state was gone.
    from server.engine import Engine

    model, tok, _ = parts
    eng = Engine(model, tok, Settings(device="cpu", max_batch=8, stats_interval=0, cuda_graphs=False,
                                      max_prompt_tokens=16))
    eng.start()
    tm = TaskManager(eng, tok, Settings(db=str(tmp_path / "p.db"), device="cpu", stats_interval=0), model.shape)
    await tm.start()
    try:
        t = await tm.wait((await tm.create(list(range(10, 24)), {"max_tokens": 12, **GREEDY}, persistent=True)).id)
        await tm.flush()
        assert len(t.tokens) == 26  # past the bound: 14 prompt + 12 generated
        await tm.store.states.drop_state(t.stored_id)
        tm.cache.discard(t.state_id)
        await tm.wait((await tm.continue_(t.id, {"max_tokens": 2}, list(range(30, 40)))).id)  # rebuilt: fine
        assert t.finish_reason == "length" and tm.counters["rebuilds"] == 1
        with pytest.raises(PromptTooLongError):  # the request's own prompt still counts
            await tm.continue_(t.id, {"max_tokens": 1}, list(range(40, 57)))
    finally:
        await tm.close()
        eng.shutdown()
