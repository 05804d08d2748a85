"""Conversation-cache benchmark: clients that re-send the whole chat history every turn.

    PYTHONPATH=. python test/bench/bench_conversation.py --model synthetic:2.9b --concurrency 256
    PYTHONPATH=. python test/bench/bench_conversation.py --model synthetic:tiny --device cpu \\
        --history-tokens 1000 --concurrency 8 --chat-turns 3 --max-tokens 16

Three figures, against a real server (uvicorn subprocess; --url to use a running one):
- ttft: one chat of --turns turns whose history grows to about --history-tokens (long user
  messages), streamed; TTFT (request sent -> first content bytes) of turn 1 and of the last
  turn, and their ratio (the goal: the last within 1.5x of the first);
- concurrent: --concurrency clients each running a --chat-turns chat (re-sending the history),
  against the same clients each sending --chat-turns fresh one-turn chats: delivered completion
  tokens per second of each, and their ratio (the goal: >= 0.9);
- retokenize: of the turns after the first, how many started from a kept state covering >= 90%
  of the previous turn's prompt + completion, and the server's counters (replies kept as
  generated vs repaired by a re-tokenized prefill), with sampled replies (--temperature).
Prints one line per figure and appends one JSON line each to test/bench/results.jsonl (--out).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import itertools
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "test"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx
import orjson
from bench_engine import commit, write_lines
from util_server import ServerProcess

from server.api.metrics import parse_metrics

SYSTEM = "You are a helpful assistant."
PARAGRAPH = ("The river runs past the old mill, under the stone bridge and through the town square, "
             "where the market opens every morning at seven. ")


def user_message(turn: int, tokens: int) -> str:
    """About `tokens` tokens of text (a paragraph is about 32 tokens)."""
    return f"Turn {turn}. " + PARAGRAPH * max(1, tokens // 32) + "What happens next?"


async def chat_turn(client: httpx.AsyncClient, msgs: list[dict], args, stream: bool = False) -> dict:
    body = {"model": "m", "messages": msgs, "max_tokens": args.max_tokens, "temperature": args.temperature,
            "top_p": 0.9, "ignore_eos": True}
    if not stream:
        r = await client.post("/v1/chat/completions", json=body)
        r.raise_for_status()
        out = r.json()
        return {"text": out["choices"][0]["message"]["content"], "usage": out["usage"]}
    t0 = time.perf_counter()
    ttft, parts, usage = None, [], None
    async with client.stream("POST", "/v1/chat/completions",
                             json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = orjson.loads(line[6:])
            if ev.get("usage"):
                usage = ev["usage"]
            for c in ev.get("choices") or ():
                if c["delta"].get("content"):
                    ttft = ttft or time.perf_counter() - t0
                    parts.append(c["delta"]["content"])
    return {"text": "".join(parts), "usage": usage, "ttft": ttft}


async def run_chat(client: httpx.AsyncClient, turns: int, msg_tokens: int, args, *, history: bool = True,
                   stream: bool = False) -> list[dict]:
    msgs: list[dict] = [{"role": "system", "content": SYSTEM}]
    out = []
    for i in range(turns):
        msgs.append({"role": "user", "content": user_message(i, msg_tokens)})
        res = await chat_turn(client, msgs if history else msgs[:1] + msgs[-1:], args, stream)
        out.append(res)
        msgs.append({"role": "assistant", "content": res["text"]})
    return out


async def ttft_figure(url: str, args) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await run_chat(client, 1, 16, args)  # warm-up
        res = await run_chat(client, args.turns, args.history_tokens // args.turns, args, stream=True)
    first, last = res[0]["ttft"], res[-1]["ttft"]
    hist = res[-1]["usage"]["prompt_tokens"]
    print(f"ttft: turn 1 {first * 1e3:.1f} ms, turn {args.turns} {last * 1e3:.1f} ms with a {hist}-token history "
          f"({res[-1]['usage']['prompt_tokens_details']['cached_tokens']} cached): ratio {last / first:.2f}")
    return {"mode": "conversation-ttft", "turns": args.turns, "history_tokens": hist,
            "ttft_first_ms": round(first * 1e3, 2), "ttft_last_ms": round(last * 1e3, 2),
            "ratio": round(last / first, 3)}


async def throughput(url: str, args, history: bool) -> tuple[float, list[list[dict]]]:
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as client:
        t0 = time.perf_counter()
        chats = await asyncio.gather(*(run_chat(client, args.chat_turns, args.msg_tokens, args, history=history)
                                       for _ in range(args.concurrency)))
        wall = time.perf_counter() - t0
    tokens = sum(t["usage"]["completion_tokens"] for chat in chats for t in chat)
    return tokens / wall, chats


async def concurrent_figure(url: str, args) -> tuple[dict, list[list[dict]]]:
    single, _ = await throughput(url, args, history=False)
    multi, chats = await throughput(url, args, history=True)
    print(f"concurrent: {args.concurrency} chats x {args.chat_turns} turns: multi-turn {multi:.0f} tok/s, "
          f"single-turn {single:.0f} tok/s: ratio {multi / single:.3f}")
    return {"mode": "conversation-concurrent", "concurrency": args.concurrency, "turns": args.chat_turns,
            "multi_tok_s": round(multi, 1), "single_tok_s": round(single, 1), "ratio": round(multi / single, 3)}, chats


def retokenize_figure(url: str, chats: list[list[dict]], args) -> dict:
    turns = hits = 0
    for chat in chats:
        for prev, cur in itertools.pairwise(chat):
            turns += 1
            full = prev["usage"]["prompt_tokens"] + prev["usage"]["completion_tokens"]
            hits += cur["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0.9 * full
    m = parse_metrics(httpx.get(url + "/metrics").text)
    kept, repairs = m.get("rwkv_conversation_cache_kept_total", 0), m.get("rwkv_conversation_cache_repairs_total", 0)
    print(f"retokenize: {hits} of {turns} later turns cached >= 90% of the previous turn; server: {kept:.0f} replies "
          f"kept as generated, {repairs:.0f} repair prefills, {m.get('rwkv_conversation_cache_waits_total', 0):.0f} "
          f"waits (temperature {args.temperature})")
    return {"mode": "conversation-retokenize", "turns": turns, "hit_turns": hits, "kept": kept, "repairs": repairs,
            "temperature": args.temperature}


async def main_async(url: str, args) -> list[dict]:
    lines = [await ttft_figure(url, args)]
    figure, chats = await concurrent_figure(url, args)
    return [*lines, figure, retokenize_figure(url, chats, args)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="synthetic:2.9b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--url", default="", help="a running server (else one is started)")
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--history-tokens", type=int, default=8000)
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--chat-turns", type=int, default=4)
    p.add_argument("--msg-tokens", type=int, default=64, help="tokens per user message in the concurrent figure")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--out", default=str(ROOT / "test/bench/results.jsonl"))
    args = p.parse_args()
    srv = None
    url = args.url
    if not url:
        env = {"RWKV_DEVICE": args.device, "RWKV_MAX_BATCH": str(max(args.concurrency, 1)),
               "RWKV_MAX_PROMPT_TOKENS": str(max(65536, 2 * args.history_tokens))}
        srv = ServerProcess(model=args.model, env=env).start(timeout=1800)
        url = srv.url
    try:
        lines = asyncio.run(main_async(url, args))
    except Exception:
        if srv is not None:  # what the server said before the client failed
            print(f"server log (last lines):\n{srv.log_tail()}", file=sys.stderr)
        raise
    finally:
        if srv is not None:
            srv.cleanup()  # stops it; removes its temporary directory
    base = {"date": dt.date.today().isoformat(), "commit": commit(), "model": args.model, "device": args.device,
            "max_tokens": args.max_tokens}
    write_lines(args.out, [{**base, **line} for line in lines])


if __name__ == "__main__":
    os.environ.setdefault("RWKV_STATS_INTERVAL", "0")
    main()
