"""Command line: `rwkv-server [serve] [flags]`, `rwkv-server synth`, `rwkv-server quantize`,
`rwkv-server generate`. The checks made before anything loads: server/checks.py.

Every Settings field is a `serve` flag (`--max-batch`, ...) whose default comes from the
environment (`RWKV_MAX_BATCH`, ...) and then from server/config.py; `--help` prints each field's
documentation.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import re
import socket
import sys
import time
from typing import Any, get_type_hints

from server.checks import (
    database_open_problem,
    device_problem,
    output_problem,
    quantize_problem,
    serve_problem,
    settings_problem,
)
from server.config import CHOICES, Settings, field_docs, redact_url

SUBCOMMANDS = ("serve", "synth", "quantize", "generate")
LOG_FORMAT = "%(asctime)s %(levelname)-7s %(name)s [%(request_id)s] %(message)s"
_SIZE = re.compile(r"^\s*([+-]?[0-9.eE+-]+)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_int(raw: str) -> int:
    """Ints, with size suffixes for budgets: 512MiB, 2GiB, 1.5G, 2e9. A sign is read (-5 is an
    integer); the ranges are settings_problem's."""
    m = _SIZE.match(raw)
    if not m:
        raise argparse.ArgumentTypeError(f"not an integer: {raw!r}")
    num, unit, _ = m.groups()
    mult = 1024 ** "_kmgt".index(unit.lower()) if unit else 1
    try:
        return int(float(num) * mult) if (unit or "e" in num.lower() or "." in num) else int(num)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {raw!r}") from None


def setup_logging(level: str) -> None:
    from server.api.middleware import RequestIdFilter

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(RedactingFormatter(LOG_FORMAT, datefmt="%H:%M:%S"))
    handler.addFilter(RequestIdFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
    if root.level > logging.DEBUG:  # Alembic's per-plugin/per-context chatter: keep the upgrades only
        logging.getLogger("alembic.runtime.plugins").setLevel(logging.WARNING)
        logging.getLogger("alembic.runtime.migration").addFilter(
            lambda r: "Context impl" not in r.getMessage() and "Will assume" not in r.getMessage()
        )


class RedactingFormatter(logging.Formatter):
    """Log lines with database URLs' passwords replaced by *** (whichever module logs the URL,
    and in tracebacks too)."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        return redact_url(text) if "://" in text else text


def add_settings_flags(p: argparse.ArgumentParser, defaults: Settings) -> None:
    docs, hints = field_docs(), get_type_hints(Settings)
    for f in dataclasses.fields(Settings):
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        env = f"RWKV_{f.name.upper()}"
        doc = docs.get(f.name, "").replace("%", "%%")
        typ = hints[f.name]
        if typ is bool:
            p.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=default, help=f"{doc} [env {env}; now: {default}]"
            )
            continue
        conv = parse_int if typ is int else typ
        shown = default if default != "" else '""'
        p.add_argument(
            flag,
            type=conv,
            default=default,
            metavar=f.name.upper(),
            choices=CHOICES.get(f.name),
            help=f"{doc} [env {env}; now: {shown}]",
        )


def build_parser(defaults: Settings) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rwkv-server",
        description="RWKV-7 inference server (task API + OpenAI API).",
        epilog="Without a subcommand, `serve` runs: `rwkv-server --model x.pth` == `rwkv-server serve --model "
        "x.pth`. See `rwkv-server serve --help` for every server flag.",
    )
    sub = parser.add_subparsers(dest="command", metavar="{serve,synth,quantize,generate}")
    serve = sub.add_parser(
        "serve",
        help="run the HTTP server (default)",
        description="Run the HTTP server. Every flag can also be set by its RWKV_* variable.",
    )
    add_settings_flags(serve, defaults)
    serve.add_argument(
        "--state",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="load an RWKV-7 state file at start as the public template _NAME (repeatable; added to --states)",
    )
    synth = sub.add_parser("synth", help="write a synthetic checkpoint (random weights) as an official .pth")
    synth.add_argument("preset", help="tiny, 0.1b, 0.4b, 1.5b, 2.9b or 7.2b, optionally :seed (e.g. tiny:3)")
    synth.add_argument("out", help="output path, e.g. tiny.pth")
    synth.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"), help="tensor dtype in the file")
    qz = sub.add_parser(
        "quantize",
        help="write an 8-bit copy of a checkpoint (later loads skip the quantization, read ~half the bytes)",
        description="Quantize a 16-bit RWKV-7 .pth as --quant does at load and write the result: "
        "`serve --model OUT` then loads it without quantizing (docs/performance.md, 8-bit weights).",
    )
    qz.add_argument("model", help="the official 16-bit checkpoint (.pth)")
    qz.add_argument("out", help="output path, e.g. model-int8.pth")
    qz.add_argument("--quant", required=True, choices=("int8", "fp8"))
    qz.add_argument("--dtype", default="fp16", choices=("fp16", "bf16", "fp32"), help="the serving compute dtype")
    qz.add_argument("--device", default="auto", help="where to quantize: auto (cuda if available), cpu, cuda")
    gen = sub.add_parser(
        "generate",
        help="load a model and generate from the command line (no HTTP)",
        description="Load a model and continue a prompt (no HTTP). Backslash escapes in the "
        "prompt are interpreted as in a Python string: "
        "rwkv-server generate 'User: Hi\\n\\nAssistant:'",
    )
    gen.add_argument(
        "prompt",
        nargs="?",
        default="User: Hello!\\n\\nAssistant:",
        help="prompt text; backslash escapes (\\n, \\t, \\\\, \\u00e9, ...) are interpreted; "
        "'-' reads the prompt from stdin as it is (default: %(default)s)",
    )
    gen.add_argument("--model", default=defaults.model, help="checkpoint .pth or synthetic:<preset>[:seed]")
    gen.add_argument("--device", default=defaults.device)
    gen.add_argument("--dtype", default=defaults.dtype)
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=1.0)
    gen.add_argument("--top-p", type=float, default=0.3)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0] not in SUBCOMMANDS and argv[0] not in ("-h", "--help")):
        argv = ["serve", *argv]
    try:
        defaults = Settings.from_env()
    except ValueError as exc:
        print(f"rwkv-server: bad environment: {exc}", file=sys.stderr)
        return 2
    args = build_parser(defaults).parse_args(argv)
    if args.command == "synth":
        return cmd_synth(args)
    if args.command == "quantize":
        return cmd_quantize(args)
    if args.command == "generate":
        return cmd_generate(args, defaults)
    return cmd_serve(args)


def load_failure(app: Any) -> str:
    """The line for a start that failed after the checks (app.state.load_error): what failed, as
    far as the app records it (app.state.load_stage: "model", "task database", "state files"),
    and why."""
    stage = str(getattr(app.state, "load_stage", ""))
    what = _LOAD_STAGES.get(stage, "could not load the model or start the task store")
    return redact_url(f"{what}: {app.state.load_error}")


_LOAD_STAGES = {
    "model": "could not load the model",
    "task database": "could not open the task database",
    "state files": "could not load the state files",
}


def cmd_serve(args: argparse.Namespace) -> int:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(Settings)}
    values["states"] = "\n".join(x for x in (values["states"], *args.state) if x)
    settings = Settings(**values)
    problem = settings_problem(settings) or serve_problem(settings)
    if problem is not None:
        print(f"rwkv-server: {problem}", file=sys.stderr)
        return 2
    setup_logging(settings.log_level)
    problem = database_open_problem(settings)  # after the logging: its schema upgrades are logged
    if problem is not None:
        print(f"rwkv-server: {problem}", file=sys.stderr)
        return 2
    from server.api.app import create_app

    app = create_app(settings, exit_on_load_error=True)
    where = f"http://{settings.host}:{settings.port}" if settings.port else f"{settings.host}, a free port (--port 0)"
    logging.getLogger("server.cli").info("starting on %s (model %s)", where, settings.resolved_model())
    make_server(app, settings).run()
    if app.state.load_error:
        print(f"rwkv-server: {load_failure(app)}", file=sys.stderr)
        return 1
    return 0


def make_server(app: Any, settings: Settings) -> Any:
    """The uvicorn server of `app`: drains the app at shutdown, logs the port bound for --port 0,
    and stops when loading fails (app.state.on_fatal)."""
    import uvicorn

    from server.api.app import begin_drain
    from server.api.http_limits import protocol_with_deadlines

    class Server(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets=sockets)
            bound = [s.getsockname() for srv in getattr(self, "servers", []) for s in srv.sockets or ()]
            if settings.port == 0 and bound:  # app.state.bound_port: for app.py's "ready" line
                app.state.bound_port = bound[0][1]
                logging.getLogger("server.cli").info("listening on port %d (--port 0)", bound[0][1])

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            begin_drain(app)  # streams end now instead of holding the graceful shutdown
            await asyncio.sleep(0.2)
            await super().shutdown(sockets=sockets)

    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_config=None,
        access_log=False,
        log_level=settings.log_level.lower(),
        timeout_graceful_shutdown=5,
        timeout_keep_alive=settings.keep_alive_timeout,
        http=protocol_with_deadlines(settings.header_timeout, settings.body_timeout, settings.max_connections),
    )
    server = Server(config)
    app.state.on_fatal = lambda: setattr(server, "should_exit", True)
    return server


def cmd_synth(args: argparse.Namespace) -> int:
    from server.api.loading import torch_dtype
    from server.model.synthetic import parse_spec, save_synthetic

    try:  # the preset first: a bad one ends here, before any weights are drawn
        parse_spec(args.preset if args.preset.startswith("synthetic:") else f"synthetic:{args.preset}")
    except ValueError as exc:
        print(f"rwkv-server: {exc}", file=sys.stderr)
        return 2
    if problem := output_problem(args.out):
        print(f"rwkv-server: {problem}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    dtype = torch_dtype(args.dtype)
    try:
        shape = save_synthetic(args.preset, args.out, dtype=dtype)
    except OSError as exc:  # the disk filled, the folder went away
        print(f"rwkv-server: cannot write {args.out}: {exc}", file=sys.stderr)
        return 1
    print(
        f"wrote {args.out}: {shape.signature()} V={shape.vocab_size} ({args.dtype}, "
        f"{time.perf_counter() - t0:.1f}s). Random weights: outputs are random text."
    )
    return 0


def cmd_quantize(args: argparse.Namespace) -> int:
    import torch

    from server.api.loading import torch_dtype
    from server.model.checkpoint import CheckpointError
    from server.model.qfile import save_quantized

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if problem := quantize_problem(args.model, args.out) or device_problem(device):
        print(f"rwkv-server: {problem}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    dtype = torch_dtype(args.dtype)
    try:
        shape, nbytes = save_quantized(args.model, args.out, args.quant, dtype, device)
    except (CheckpointError, FileNotFoundError, ValueError) as exc:
        print(f"rwkv-server: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # writing: the disk filled, the folder went away
        print(f"rwkv-server: cannot write {args.out}: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {args.out}: {shape.signature()}, {args.quant} linears, {nbytes / 1e9:.2f} GB of tensors "
          f"({time.perf_counter() - t0:.1f}s on {device}). Serve it with --model {args.out}.")  # fmt: skip
    return 0


def sampling_problem(args: argparse.Namespace) -> str | None:
    """generate's sampling flags outside their ranges (the engine's own check), or None."""
    if args.max_tokens < 0:
        return f"--max-tokens {args.max_tokens}: must be 0 or more"
    if args.temperature < 0:
        return f"--temperature {args.temperature}: must be 0 or more (0: greedy)"
    if not 0 <= args.top_p <= 1:
        return f"--top-p {args.top_p}: must be between 0 and 1"
    return None


def prompt_text(raw: str) -> str:
    """The generate prompt: stdin as it is for '-', else the argument with its backslash escapes
    interpreted (ValueError naming a bad escape)."""
    if raw == "-":
        return sys.stdin.read()
    try:  # non-Latin-1 characters pass through as \\u escapes, so any text survives unicode_escape
        return raw.encode("latin-1", "backslashreplace").decode("unicode_escape")
    except UnicodeDecodeError as exc:
        raise ValueError(f"bad backslash escape in the prompt at character {exc.start}: {exc.reason}") from None


def cmd_generate(args: argparse.Namespace, defaults: Settings) -> int:
    settings = defaults.replace(model=args.model, device=args.device, dtype=args.dtype, stats_interval=0)
    try:
        prompt = prompt_text(args.prompt)
    except ValueError as exc:
        print(f"rwkv-server generate: {exc}", file=sys.stderr)
        return 2
    problem = sampling_problem(args) or settings_problem(settings)
    if problem is not None:
        print(f"rwkv-server generate: {problem}", file=sys.stderr)
        return 2
    setup_logging("warning")
    from server.api.loading import load_services
    from server.engine.types import SamplingParams

    sv = load_services(settings)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        stop=tuple(args.stop),
    )
    try:
        t0 = time.perf_counter()
        try:
            h = sv.engine.submit(prompt, params)
        except ValueError as exc:  # parameters the engine refuses (a prompt too long, ...)
            print(f"rwkv-server generate: {exc}", file=sys.stderr)
            return 2
        sys.stdout.write(prompt)
        for ev in h:
            sys.stdout.write(ev.text)
            sys.stdout.flush()
        res = h.result()
        dt = time.perf_counter() - t0
        print(
            f"\n[{res.completion_tokens} tokens, finish {res.finish_reason}, {dt:.2f}s, "
            f"prompt {res.prompt_tokens} tokens]",
            file=sys.stderr,
        )
    finally:
        sv.engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
