"""The Conversations API's state reuse: one conversation of --turns turns through /v1/responses,
five ways a client keeps it, against a real server (uvicorn subprocess; --url to use a running
one):

- conversation: `conversation` on each response (the server keeps the items and forks the last
  response's state: only the new turn is prefilled);
- chain: `previous_response_id` (the same state reuse, the client keeping the ids);
- stateless: the whole history sent back as `input` each turn (what a client without either
  does; every turn prefills it all);
- compacted: as the Agents SDK's OpenAIResponsesCompactionSession compacting after every turn:
  each turn's input is the last compaction's output and the new message, then
  `responses.compact(previous_response_id=...)` (its time counted in the turn's);
- auto-compacted: stateless, with `context_management` (--compact-threshold): the server
  compacts past the threshold and the client drops the items before the newest compaction item.

    PYTHONPATH=. python test/bench/bench_conversations_api.py --model synthetic:tiny --device cpu
    PYTHONPATH=. python test/bench/bench_conversations_api.py --model synthetic:2.9b --turns 20 --turn-tokens 400

Per way: the tokens the server prefilled (its rwkv_prompt_tokens_total), the last turn's
input_tokens and cached_tokens, and the last turn's and the mean turn's latency. Prints one line
per way and appends one JSON line each to test/bench/results.jsonl (--out).
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "test"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx
from bench_engine import commit, write_lines
from openai import OpenAI
from util_server import ServerProcess

from server.api.metrics import parse_metrics

PARAGRAPH = (
    "The river runs past the old mill, under the stone bridge and through the town square, "
    "where the market opens every morning at seven. "
)


WAYS = ("conversation", "chain", "stateless", "compacted", "auto-compacted")


def message(turn: int, tokens: int) -> str:
    """About `tokens` tokens of text (a paragraph is about 32 tokens)."""
    return f"Turn {turn}. " + PARAGRAPH * max(1, tokens // 32) + "What happens next?"


def prefilled(url: str) -> float:
    return parse_metrics(httpx.get(url + "/metrics", timeout=30).text)["rwkv_prompt_tokens_total"]


def run(url: str, way: str, args) -> dict:
    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    kw = {"model": "m", "max_output_tokens": args.max_tokens, "temperature": 0}
    conv = client.conversations.create() if way == "conversation" else None
    history: list = []
    prev, times, r = None, [], None
    before = prefilled(url)
    for turn in range(args.turns):
        text = message(turn, args.turn_tokens)
        t0 = time.perf_counter()
        if way == "conversation":
            r = client.responses.create(conversation=conv.id, input=text, **kw)
        elif way == "chain":
            r = client.responses.create(previous_response_id=prev, input=text, **kw)
        elif way == "compacted":
            r = client.responses.create(input=[*history, {"role": "user", "content": text}], **kw)
            done = client.responses.compact(model="m", previous_response_id=r.id)
            history = [o.model_dump(exclude_none=True, warnings=False) for o in done.output]
        else:
            history.append({"role": "user", "content": text})
            auto = {"context_management": [{"type": "compaction", "compact_threshold": args.compact_threshold}]}
            r = client.responses.create(input=history, **kw, **(auto if way == "auto-compacted" else {}))
            history.extend(o.model_dump(exclude_none=True, warnings=False) for o in r.output)
            cut = [i for i, it in enumerate(history) if it.get("type") == "compaction"]
            history = history[cut[-1] :] if cut else history
        times.append(time.perf_counter() - t0)
        prev = r.id
    assert r is not None
    return {
        "way": way,
        "turns": args.turns,
        "prefilled_tokens": int(prefilled(url) - before),
        "last_input_tokens": r.usage.input_tokens,
        "last_cached_tokens": r.usage.input_tokens_details.cached_tokens,
        "last_turn_ms": round(times[-1] * 1000, 1),
        "mean_turn_ms": round(sum(times) / len(times) * 1000, 1),
    }


def _gpu_name(device: str) -> str:
    """The GPU's name (what results.jsonl's other lines say), else the device as given."""
    try:
        import torch

        return torch.cuda.get_device_name(torch.device(device))
    except Exception:
        return device


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="synthetic:tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--url", help="a running server (else one is started)")
    ap.add_argument("--turns", type=int, default=12)
    ap.add_argument("--turn-tokens", type=int, default=200, help="about this many tokens per user turn")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--compact-threshold", type=int, default=1000, help="auto-compacted: context_management's")
    ap.add_argument("--ways", default=",".join(WAYS), help="comma-separated, of " + ", ".join(WAYS))
    ap.add_argument("--out", default=str(ROOT / "test" / "bench" / "results.jsonl"))
    args = ap.parse_args()
    srv = None
    if args.url is None:
        srv = ServerProcess(model=args.model, args=["--device", args.device])
        srv.start()
    url = args.url or srv.url
    try:
        lines = []
        for way in args.ways.split(","):
            fig = run(url, way, args)
            print(
                f"{way:12s} prefilled {fig['prefilled_tokens']:7d} tokens over {args.turns} turns; last turn: "
                f"input {fig['last_input_tokens']}, cached {fig['last_cached_tokens']}, "
                f"{fig['last_turn_ms']:.0f} ms (mean turn {fig['mean_turn_ms']:.0f} ms)",
                flush=True,
            )
            gpu = "cpu" if args.device == "cpu" else _gpu_name(args.device)
            lines.append({"date": dt.date.today().isoformat(), "commit": commit(), "gpu": gpu, "model": args.model,
                          "mode": "conversations_api", "turn_tokens": args.turn_tokens,
                          "max_tokens": args.max_tokens, **fig,
                          **({"compact_threshold": args.compact_threshold} if way == "auto-compacted" else {})})  # fmt: skip
        write_lines(args.out, lines)
    finally:
        if srv is not None:
            srv.stop()
            srv.cleanup()


if __name__ == "__main__":
    main()
