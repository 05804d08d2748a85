"""Task-layer figures: fork-then-generate vs full prefill for a long template, state
write/read throughput to SQLite, and what a smaller storage dtype or a compressor saves.

    python test/bench/bench_tasks.py                       # 0.1b preset on CPU, 2,000-token template
    python test/bench/bench_tasks.py --model synthetic:tiny --template-tokens 500 --states 1.5b
    python test/bench/bench_tasks.py --skip-fork --skip-io --storage 2.9b
        # bytes and encode/decode ms per state: working dtype, fp16 WKV, zstd / lz4 (when
        # installed: pip install zstandard lz4), on a random state of that shape and on a state
        # the 0.1b preset computed from a 300-token prompt

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
from server.tasks.statestore import state_row  # noqa: E402
from server.tasks.store import Store  # noqa: E402

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
            row = await store.states.get_state(f"s{i}")
            back = await asyncio.to_thread(decode_state, orjson.loads(row.meta), row.data, sig, row.checksum)
        t_r = time.perf_counter() - t0
        assert torch.equal(back.wkv, st.wkv)
        await store.close()
        print(f"state {preset}: {mb:.1f} MiB/state, {n} states: write {n * mb / t_w:.0f} MiB/s "
              f"({t_w / n * 1000:.1f} ms/state, encode + checksum + commit with fsync), "
              f"read {n * mb / t_r:.0f} MiB/s ({t_r / n * 1000:.1f} ms/state, read + checksum + decode)")


def _real_state():
    """A state the synthetic 0.1b model computed (value ranges of a recurrence, not noise)."""
    from server.model import load_model
    from server.tokenizer import get_tokenizer

    model = load_model("synthetic:0.1b", device="cpu", dtype=torch.float32, state_dtype=torch.float32)
    text = " ".join(f"Paragraph {i}: the quick brown fox jumps over the lazy dog." for i in range(30))
    st = model.zero_state(1)
    model.forward([get_tokenizer().encode(text)[:300]], st)
    return st


def _best_ms(fn, n: int = 3) -> tuple[object, float]:
    best, out = float("inf"), None
    for _ in range(n):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return out, best * 1000


def storage(args) -> None:
    """Bytes per state and encode/decode time (one thread) for each way of storing it."""
    from server.model.synthetic import parse_spec

    torch.set_num_threads(1)
    comps = []
    try:
        import zstandard

        comps += [(f"zstd-{lvl}", zstandard.ZstdCompressor(level=lvl).compress, zstandard.ZstdDecompressor().decompress)
                  for lvl in (1, 3)]
    except ImportError:
        print("(zstandard not installed: no zstd rows)")
    try:
        import lz4.frame

        comps.append(("lz4", lz4.frame.compress, lz4.frame.decompress))
    except ImportError:
        print("(lz4 not installed: no lz4 rows)")
    cases = [("0.1b, computed from a 300-token prompt", _real_state(), "s")]
    for preset in args.storage.split(","):
        shape, _ = parse_spec(f"synthetic:{preset}")
        st = State.zeros(shape, 1)
        for t in st.tensors():
            t.normal_()
        cases.append((f"{preset}, random normal", st, shape.signature()))
    for label, st, sig in cases:
        base = st.nbytes()
        print(f"{label}: {base / 2**20:.1f} MiB in fp32")
        for dtype in (None, "float16"):
            enc, t_enc = _best_ms(lambda: encode_state(st, sig, wkv_dtype=dtype))
            _, t_dec = _best_ms(lambda: decode_state(enc.meta, enc.data, sig, enc.checksum))
            name = "working dtype" if dtype is None else "fp16 WKV"
            print(f"  {name:14s} {enc.nbytes / base:6.1%}  encode {t_enc:6.1f} ms  decode {t_dec:6.1f} ms")
            for cname, comp, dec in comps:
                z, t_z = _best_ms(lambda: comp(bytes(enc.data)))
                _, t_dz = _best_ms(lambda: dec(z))
                print(f"    + {cname:10s} {len(z) / base:6.1%}  +{t_z:6.1f} ms  +{t_dz:6.1f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="synthetic:0.1b")
    ap.add_argument("--template-tokens", type=int, default=2000)
    ap.add_argument("--gen-tokens", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--states", default="0.1b,1.5b,2.9b", help="presets for the state I/O figure")
    ap.add_argument("--skip-fork", action="store_true")
    ap.add_argument("--skip-io", action="store_true")
    ap.add_argument("--storage", default="", help="presets for the storage dtype / compression figure")
    args = ap.parse_args()
    if not args.skip_fork:
        asyncio.run(fork_vs_prefill(args))
    if not args.skip_io:
        asyncio.run(state_io(args))
    if args.storage:
        storage(args)


if __name__ == "__main__":
    main()
