"""Host (Python) overhead of the engine per step per sequence, with a model and a sampler that cost
nothing: what is left is the scheduler, runner bookkeeping, detokenizing, stop checks, events,
and the asyncio consumers (one task per request iterating its events, as the HTTP layer does).

    PYTHONPATH=. python test/bench/bench_engine_host.py                  # B = 64, 256, 1024
    PYTHONPATH=. python test/bench/bench_engine_host.py --batches 256 --profile   # cProfile, engine thread
    PYTHONPATH=. python test/bench/bench_engine_host.py --batches 256,1024 --gpu-ms 10 --critical --consumers none
        # host time on the critical path per step (ids on the host -> next launch) vs overlapped work

Figures, per generated token (= per sequence per step in the steady state; ramp-up included):
"engine us/seq" = the engine thread's step time (its own Python work); "wall us/seq" = wall time,
with the consumers running in another thread (they compete for the GIL, as the server's event
loop does). BENCH_FAKE_SHAPE=2.9b (also for bench_http_host.py): the fake model's states get that
preset's size (21 MB each in fp32), so that finished tasks copy and store real-sized states. On the GPU the engine waits ~13 ms per step at
B=256 with the GIL released; everything here is on top of (or, with the GIL, interleaved with) it.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import pstats
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from server.config import Settings  # noqa: E402
from server.engine import Engine, SamplingParams  # noqa: E402
from server.model.state import ModelShape, State  # noqa: E402
from server.tokenizer import get_tokenizer  # noqa: E402

SHAPE = ModelShape(n_layer=1, n_embd=8, n_head=1, head_size=4, vocab_size=65536, ffn_dim=32,
                   d_decay=4, d_aaa=4, d_mv=4, d_gate=4)  # fmt: skip
if os.environ.get("BENCH_FAKE_SHAPE"):  # e.g. 2.9b: the fake model's states get that model's size
    from server.model.synthetic import parse_spec  # noqa: E402

    SHAPE = parse_spec("synthetic:" + os.environ["BENCH_FAKE_SHAPE"])[0]


class FakeModel:
    """forward/decode return at once (decode: a preallocated (B, 1) tensor; the sampler ignores it)."""

    def __init__(self):
        self.shape, self.name, self.device = SHAPE, "fake", torch.device("cpu")
        self.dtype = self.state_dtype = torch.float32
        self._logits = torch.zeros(4096, 1)

    def zero_state(self, batch: int) -> State:
        return State.zeros(SHAPE, batch)

    def forward(self, tokens, state, slots=None):
        return self._logits[: len(tokens)]

    def decode(self, token_ids, state, raw_logits=False):
        return self._logits[: token_ids.shape[0]]


class FakeSampler:
    """Cycles through the ids of ordinary words (realistic detokenizing); no vocabulary math."""

    def __init__(self, ids: list[int]):
        self.ids = torch.tensor(ids * 64, dtype=torch.long)
        self.i = 0

    def reset(self, slots, params, seeds):
        pass

    def move(self, pairs):
        pass

    def sample(self, logits, positions, commit, greedy_only=False, resolve=None):
        B = logits.shape[0]
        self.i = (self.i + 7) % (len(self.ids) - B - 1) if len(self.ids) > B + 1 else 0
        return self.ids[self.i : self.i + B]

    def resolve(self, logits, rows, positions, commit):
        raise AssertionError("no overflow rows here")


class CritTimer:
    """Host time on the critical path: from a step's token ids being on the host (the simulated
    D2H copy complete) to the next step's launch returning (the device busy again), vs. the host
    work done while the device runs (launch returned -> start of the wait for the device)."""

    def __init__(self):
        self.t_ready: float | None = None  # the last step's ids on the host
        self.t_launched: float | None = None
        self.crit: list[float] = []
        self.overlap: list[float] = []
        self.launch: list[float] = []  # the runner's launch() call alone (part of crit)

    def reset(self) -> None:
        self.t_ready = self.t_launched = None
        self.crit, self.overlap, self.launch = [], [], []

    def summary(self) -> tuple[float, float, float]:
        def med(xs):
            xs = sorted(xs)
            return 1e6 * xs[len(xs) // 2] if xs else float("nan")

        return med(self.crit), med(self.overlap), med(self.launch)


def simulate_device(engine: Engine, gpu_ms: float, timer: CritTimer | None = None) -> None:
    """Make each decode take gpu_ms from its launch, waiting with the GIL released (like the
    CUDA event wait); events are delivered after the next launch, as on CUDA."""
    r, s = engine.runner, gpu_ms / 1e3
    if hasattr(r, "finish"):
        engine.defer_delivery = True
        launch, finish = r.launch, r.finish

        def launch_timed(*args, **kw):
            t = time.perf_counter()
            job = launch(*args, **kw)
            if job is not None:
                job.t_device = time.perf_counter()
                if timer is not None:
                    if timer.t_ready is not None:
                        timer.launch.append(job.t_device - t)
                    if timer.t_ready is not None:
                        timer.crit.append(job.t_device - timer.t_ready)
                    timer.t_launched, timer.t_ready = job.t_device, None
            return job

        def finish_timed(job):
            if job is not None:
                t = time.perf_counter()
                if timer is not None and timer.t_launched is not None:
                    timer.overlap.append(t - timer.t_launched)
                time.sleep(max(0.0, s - (t - job.t_device)))
                if timer is not None:
                    timer.t_ready = time.perf_counter()  # the D2H copy is complete here
            return finish(job)

        r.launch, r.finish = launch_timed, finish_timed
    else:  # the engine before the launch/finish split: the wait was inside decode
        decode = r.decode

        def decode_timed(plan):
            t = time.perf_counter()
            out = decode(plan)
            time.sleep(max(0.0, s - (time.perf_counter() - t)))
            return out

        r.decode = decode_timed


def cpu_timed_step(engine: Engine, acc: list[float]) -> None:
    """Count the engine thread's CPU time (not its waits for the GIL or the device)."""
    step = engine.step

    def timed():
        engine._starts.append(time.perf_counter())
        c = time.thread_time()
        try:
            step()
        finally:
            acc[0] += time.thread_time() - c

    engine.step = timed


async def consume(engine: Engine, prompt: list[int], params: SamplingParams) -> int:
    h = engine.submit(prompt, params)
    n = 0
    async for ev in h:
        n += len(ev.token_ids)
        if ev.text:  # what an SSE writer would do per event: a small dict -> bytes
            _ = repr({"choices": [{"delta": {"content": ev.text}, "index": 0}]}).encode()
    return n


def run(engine: Engine, B: int, tokens: int, stop: tuple[str, ...], sampling_kind: str, consumers: str = "async",
        timer: CritTimer | None = None) -> dict:  # fmt: skip
    prompt = get_tokenizer().encode("The quick brown fox jumps over the lazy dog.")
    if sampling_kind == "greedy":
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, stop=stop)
    else:
        params = SamplingParams(max_tokens=tokens, ignore_eos=True, stop=stop, seed=1)

    async def main():
        c = time.thread_time()
        out = await asyncio.gather(*(consume(engine, prompt, params) for _ in range(B)))
        return out, time.thread_time() - c

    def no_consumers():  # events are queued on the handles, nobody reads them (like bench_engine_e2e)
        c = time.thread_time()
        handles = [engine.submit(prompt, params) for _ in range(B)]
        return [h.result().completion_tokens for h in handles], time.thread_time() - c

    s0, t0, e0 = engine.stats(), time.perf_counter(), engine._cpu[0]
    engine._starts = []
    if timer is not None:
        timer.reset()
    result: list = []
    target = (lambda: result.append(asyncio.run(main()))) if consumers == "async" else (lambda: result.append(no_consumers()))
    th = threading.Thread(target=target)
    th.start()
    th.join()
    wall = time.perf_counter() - t0
    s1 = engine.stats()
    steps = s1.steps - s0.steps
    counts, loop_cpu = result[0]
    assert sum(counts) == B * tokens, (sum(counts), B * tokens)
    periods = sorted(b - a for a, b in zip(engine._starts, engine._starts[1:]))
    n = B * tokens  # per generated token = per sequence per step (in the steady state)
    crit, overlap, launch = timer.summary() if timer is not None else (float("nan"),) * 3
    return {"B": B, "steps": steps, "engine_us": 1e6 * (engine._cpu[0] - e0) / n, "loop_us": 1e6 * loop_cpu / n,
            "wall_us": 1e6 * wall / n, "step_ms": 1e3 * periods[len(periods) // 2],
            "tok_s": n / wall, "crit_us": crit, "overlap_us": overlap, "launch_us": launch}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="64,256,1024")
    ap.add_argument("--tokens", type=int, default=256, help="tokens generated per request")
    ap.add_argument("--stop", default="", help="comma-separated stop strings for every request")
    ap.add_argument("--sampling", default="default", choices=["default", "greedy"])
    ap.add_argument("--gpu-ms", type=float, default=0.0, help="simulated device time per decode step")
    ap.add_argument("--critical", action="store_true",
                    help="also report the host time on the critical path per step (ids on the host -> next "
                         "launch returned) and the host work overlapped with the device (launch -> wait)")  # fmt: skip
    ap.add_argument("--consumers", default="async", choices=["async", "none"],
                    help="none: events are not consumed (the engine alone, like bench_engine_e2e)")
    ap.add_argument("--profile", action="store_true", help="cProfile the engine thread (last batch size)")
    ap.add_argument("--switch-ms", type=float, default=0.0, help="sys.setswitchinterval (0: leave as is)")
    a = ap.parse_args()
    if a.switch_ms:
        sys.setswitchinterval(a.switch_ms / 1e3)
    tok = get_tokenizer()
    words = tok.encode(" the quick brown fox jumps over the lazy dog, and then it runs away. ")
    stop = tuple(s for s in a.stop.split(",") if s)
    print(f"gpu_ms={a.gpu_ms}; per generated token: engine thread CPU us, consumer loop CPU us, wall us; "
          f"median ms per step (includes the simulated device time)")
    if a.critical:
        print("crit us/step: median host time from a step's ids on the host to the next launch returned "
              "(launch us: of which the runner's launch() call, with the fake model's eager decode + sampler); "
              "overlap us/step: median host work between a launch and the wait for the device")
    print(f"{'B':>5} {'steps':>6} {'engine us':>10} {'loop us':>8} {'wall us':>8} {'step ms':>8} {'tok/s':>9}"
          + (f" {'crit us':>8} {'us/seq':>7} {'launch us':>9} {'overlap us':>10}" if a.critical else ""))  # fmt: skip
    for B in [int(x) for x in a.batches.split(",")]:
        engine = Engine(FakeModel(), tok, Settings(max_batch=B, step_token_budget=max(4096, 2 * B),
                                                   stats_interval=0.0, max_queue=0))  # fmt: skip
        engine.start()
        engine.runner.sampler = FakeSampler(words)
        engine._cpu, engine._starts = [0.0], []
        cpu_timed_step(engine, engine._cpu)
        timer = CritTimer() if a.critical else None
        if a.gpu_ms > 0 or a.critical:
            simulate_device(engine, a.gpu_ms, timer)
        prof = cProfile.Profile() if a.profile else None
        try:
            run(engine, B, 4, stop, a.sampling, a.consumers, timer)  # warm-up
            if prof is not None:
                _profile_engine_thread(engine, prof)
            r = run(engine, B, a.tokens, stop, a.sampling, a.consumers, timer)
        finally:
            engine.shutdown()
        print(f"{r['B']:5d} {r['steps']:6d} {r['engine_us']:10.1f} {r['loop_us']:8.1f} {r['wall_us']:8.1f} "
              f"{r['step_ms']:8.2f} {r['tok_s']:9.0f}"
              + (f" {r['crit_us']:8.0f} {r['crit_us'] / B:7.2f} {r['launch_us']:9.0f} {r['overlap_us']:10.0f}"
                 if a.critical else ""))  # fmt: skip
        if prof is not None:
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def _profile_engine_thread(engine: Engine, prof: cProfile.Profile) -> None:
    """Wrap the engine's step so the profile covers the engine thread only."""
    step = engine.step

    def profiled():
        prof.enable()
        try:
            step()
        finally:
            prof.disable()

    engine.step = profiled


if __name__ == "__main__":
    main()
