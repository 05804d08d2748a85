"""Task-layer figures: fork-then-generate vs full prefill for a long template, and state
write/read throughput to SQLite.

    python test/bench/bench_tasks.py                       # 0.1b preset on CPU, 2,000-token template
    python test/bench/bench_tasks.py --model synthetic:tiny --template-tokens 500 --states 1.5b

Prints one line per figure. Synthetic weights: timings only, never quality.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import orjson  # noqa: E402
import torch  # noqa: E402

from server.config import Settings  # noqa: E402
from server.model.state import State  # noqa: E402
from server.tasks.codec import decode_state, encode_state  # noqa: E402
from server.tasks.store import Store, state_row  # noqa: E402

GREEDY = {"temperature": 0, "presence_penalty": 0, "repetition_penalty": 0}


async def fork_vs_prefill(args) -> None:
    from server.engine import Engine
    from server.model import load_model
    from server.tasks import TaskManager
    from server.tokenizer import get_tokenizer

    torch.set_num_threads(args.threads or torch.get_num_threads())
    model = load_model(args.model, device="cpu", dtype=torch.float32, state_dtype=torch.float32)
    tok = get_tokenizer()
    s = Settings(db=os.path.join(tempfile.mkdtemp(), "bench.db"), device="cpu", stats_interval=0,
                 cuda_graphs=False, max_batch=4)
    eng = Engine(model, tok, s).start()
    tm = TaskManager(eng, tok, s, model.shape)
    await tm.start()
    text = " ".join(f"Paragraph {i}: the quick brown fox jumps over the lazy dog." for i in range(400))
    ids = tok.encode(text)[: args.template_tokens]
    question = tok.encode(" Question: what did the fox do in paragraph 7? Answer:")
    n = args.gen_tokens
    print(f"model {args.model} on cpu ({torch.get_num_threads()} threads); template {len(ids)} tokens, "
          f"fork prompt {len(question)} tokens, {n} generated tokens, greedy")
    await tm.wait((await tm.create(ids[:64], {"max_tokens": 2})).id)  # warm-up

    t0 = time.perf_counter()
    base = await tm.wait((await tm.create(ids, {"max_tokens": 0}, persistent=True)).id)
    tpl = await tm.as_template(base.id, name="bench")
    t_tpl = time.perf_counter() - t0
    print(f"template prefill + store: {t_tpl:.2f} s ({len(ids) / t_tpl:.0f} tok/s)")
    for label, make in (("fork of the template", lambda: tm.fork(tpl.id, {"max_tokens": n, **GREEDY}, question)),
                        ("full prefill        ", lambda: tm.create(ids + question, {"max_tokens": n, **GREEDY}))):
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            t = await tm.wait((await make()).id)
            times.append((time.perf_counter() - t0, t.prefill_time, t.prompt_tokens))
        best = min(times)
        print(f"{label}: {best[0]:.3f} s total, time to first token {best[1]:.3f} s, "
              f"{best[2]} tokens prefilled (best of {args.repeat})")
    await tm.close()
    eng.shutdown()


async def state_io(args) -> None:
    from server.model.synthetic import parse_spec

    for preset in args.states.split(","):
        shape, _ = parse_spec(f"synthetic:{preset}")
        st = State.zeros(shape, 1)
        for t in st.tensors():
            t.normal_()
        sig = shape.signature()
        path = os.path.join(tempfile.mkdtemp(), "io.db")
        store = Store(path)
        await store.open()
        mb = st.nbytes() / 2**20
        n = max(3, min(50, int(400 / mb)))
        t0 = time.perf_counter()
        for i in range(n):
            enc = await asyncio.to_thread(encode_state, st, sig)
            await store.save(state=state_row(f"s{i}", "TASK_bench", enc, False))
        t_w = time.perf_counter() - t0
        t0 = time.perf_counter()
        for i in range(n):
            row = await store.get_state(f"s{i}")
            back = await asyncio.to_thread(decode_state, orjson.loads(row.meta), row.data, sig, row.checksum)
        t_r = time.perf_counter() - t0
        assert torch.equal(back.wkv, st.wkv)
        await store.close()
        print(f"state {preset}: {mb:.1f} MiB/state, {n} states: write {n * mb / t_w:.0f} MiB/s "
              f"({t_w / n * 1000:.1f} ms/state, encode + checksum + commit with fsync), "
              f"read {n * mb / t_r:.0f} MiB/s ({t_r / n * 1000:.1f} ms/state, read + checksum + decode)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="synthetic:0.1b")
    ap.add_argument("--template-tokens", type=int, default=2000)
    ap.add_argument("--gen-tokens", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--states", default="0.1b,1.5b,2.9b", help="presets for the state I/O figure")
    ap.add_argument("--skip-fork", action="store_true")
    args = ap.parse_args()
    if not args.skip_fork:
        asyncio.run(fork_vs_prefill(args))
    asyncio.run(state_io(args))


if __name__ == "__main__":
    main()
