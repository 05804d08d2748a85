"""Command line: `rwkv-server [serve] [flags]`, `rwkv-server synth`, `rwkv-server quantize`,
`rwkv-server generate`. The checks made before anything loads: server/checks.py (synth's and
quantize's arguments: server/checks_args.py).

Every Settings field is a `serve` flag (`--max-batch`, ...) whose default comes from the
environment (`RWKV_MAX_BATCH`, ...) and then from server/config.py; `--help` prints each field's
documentation.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import math
import os
import re
import signal
import socket
import sys
import time
from typing import TYPE_CHECKING, NoReturn

from server.checks import database_open_problem, device_problem, serve_problem, settings_problem
from server.checks_args import output_problem, quantize_problem, stdout_problem, synth_problem
from server.cli_parser import GENERATE_MAX_TOKENS, bad_environment, build_parser
from server.config import Settings, redact_url, warn_unknown_variables

if TYPE_CHECKING:  # the app and the server are imported by `serve` only
    import uvicorn
    from fastapi import FastAPI

SUBCOMMANDS = ("serve", "synth", "quantize", "generate")
LOG_FORMAT = "%(asctime)s %(levelname)-7s %(name)s [%(request_id)s] %(message)s"


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


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0] not in SUBCOMMANDS and argv[0] not in ("-h", "--help")):
        argv = ["serve", *argv]
    defaults, bad_env = Settings.from_env_lenient()  # a bad variable: refused by the command that uses it
    args = build_parser(defaults, bad_env).parse_args(argv)
    try:
        if args.command == "synth":
            return cmd_synth(args)
        if args.command == "quantize":
            return cmd_quantize(args)
        if args.command == "generate":
            if bad_env:  # generate runs the engine with the other settings as they are
                print(f"rwkv-server generate: bad environment: {next(iter(bad_env.values()))}", file=sys.stderr)
                return 2
            return cmd_generate(args, defaults)
        return cmd_serve(args)
    except KeyboardInterrupt:  # Ctrl-C: serve's graceful stop is over (uvicorn raised SIGINT again)
        end_by_sigint()


def end_by_sigint() -> NoReturn:
    """End the process as one Ctrl-C stopped: by SIGINT, its default action restored (a shell
    shows 130; a parent sees the signal, as after serve's SIGTERM), without the traceback Python
    prints for an uncaught KeyboardInterrupt. The command cleaned up on its way out (serve's
    graceful stop; generate's engine)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe
            pass
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)
    sys.exit(128 + signal.SIGINT)  # (only if the signal is blocked)


def load_failure(app: FastAPI) -> str:
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
    if problem := bad_environment(values):
        print(f"rwkv-server: {problem}", file=sys.stderr)
        return 2
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
    from server.tasks.lease import name_problem

    problem = name_problem(settings)  # a live server under this --instance-name: refused
    if problem is not None:
        print(f"rwkv-server: {problem}", file=sys.stderr)
        return 2
    from server.api.app import create_app

    log = logging.getLogger("server.cli")
    warn_unknown_variables()
    if settings.db_in_memory():
        log.warning("--db %s: the task database is in memory: tasks and templates are lost when the server stops "
                    "(not persisted)", settings.db_shown())  # fmt: skip
    app = create_app(settings, exit_on_load_error=True)
    where = settings.listen_url() if settings.port else f"{settings.host}, a free port (--port 0)"
    log.info("starting on %s (model %s)", where, settings.resolved_model())
    make_server(app, settings).run()
    if refusal := getattr(app.state, "load_refusal", None):
        print(f"rwkv-server: {refusal}", file=sys.stderr)
        return 2
    if app.state.load_error:
        print(f"rwkv-server: {load_failure(app)}", file=sys.stderr)
        return 1
    return 0


def make_server(app: FastAPI, settings: Settings) -> uvicorn.Server:
    """The uvicorn server of `app`: drains the app at shutdown (requests still waiting for their
    body too: BodyReads), logs the port bound for --port 0, and stops when loading fails
    (app.state.on_fatal)."""
    import uvicorn

    from server.api.app import begin_drain
    from server.api.body_reads import BodyReads
    from server.api.http_limits import protocol_with_deadlines

    body_reads = BodyReads(app)

    class Server(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets=sockets)
            bound = [s.getsockname() for srv in getattr(self, "servers", []) for s in srv.sockets or ()]
            if settings.port == 0 and bound:  # app.state.bound_port: for app.py's "ready" line
                app.state.bound_port = bound[0][1]
                logging.getLogger("server.cli").info("listening on port %d (--port 0)", bound[0][1])

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            begin_drain(app)  # streams end now instead of holding the graceful shutdown
            body_reads.drain()  # and so do requests still waiting for their body
            await asyncio.sleep(0.2)
            await super().shutdown(sockets=sockets)

    config = uvicorn.Config(
        body_reads,
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


_TORCH_CHECK = re.compile(r"^\[enforce fail at [^\]]*\][^.]*\.\s*")
"""The C++ check that torch's RuntimeErrors begin with ("[enforce fail at alloc_cpu.cpp:127] err == 0. ")."""


def torch_message(exc: BaseException) -> str:
    """An error's text on one line, without torch's C++ check: what failed."""
    return " ".join(_TORCH_CHECK.sub("", str(exc)).split()) or type(exc).__name__


def write_failure(command: str, out: str, exc: BaseException) -> str:
    """The line for a RuntimeError or MemoryError of synth or quantize: torch.save's file writer
    raises RuntimeError, not OSError, when it cannot open or write `out`; the rest (memory ran out
    while the weights were drawn or quantized) is what failed."""
    text = str(exc)
    if any(s in text for s in ("PytorchStreamWriter", "inline_container", "open file failed", "cannot be opened")):
        return f"cannot write {out}: {torch_message(exc)}"
    return f"{command} failed: {type(exc).__name__}: {torch_message(exc)}"


def cmd_synth(args: argparse.Namespace) -> int:
    from server.api.loading import torch_dtype
    from server.model.synthetic import save_synthetic

    # the preset first: a bad one, or one too large for memory, ends here before any weights are drawn
    problem = synth_problem(args.preset, 4 if args.dtype == "fp32" else 2)
    if problem := problem or stdout_problem(args.out) or output_problem(args.out):
        print(f"rwkv-server: {problem}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    dtype = torch_dtype(args.dtype)
    try:
        shape = save_synthetic(args.preset, args.out, dtype=dtype)
    except OSError as exc:  # the disk filled, the folder went away
        print(f"rwkv-server: cannot write {args.out}: {exc}", file=sys.stderr)
        return 1
    except (RuntimeError, MemoryError) as exc:  # torch.save's writer failed, or memory ran out
        print(f"rwkv-server: {write_failure('synth', args.out, exc)}", file=sys.stderr)
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
    if problem := stdout_problem(args.out) or quantize_problem(args.model, args.out) or device_problem(device):
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
    except (RuntimeError, MemoryError) as exc:  # torch.save's writer failed, or memory ran out
        print(f"rwkv-server: {write_failure('quantize', args.out, exc)}", file=sys.stderr)
        return 1
    print(f"wrote {args.out}: {shape.signature()}, {args.quant} linears, {nbytes / 1e9:.2f} GB of tensors "
          f"({time.perf_counter() - t0:.1f}s on {device}). Serve it with --model {args.out}.")  # fmt: skip
    return 0


GENERATE_FIELDS = ("max_tokens", "temperature", "top_p", "seed")
"""generate's sampling flags, checked against the API's bounds (server.engine.types.LIMITS)."""


def sampling_problem(args: argparse.Namespace, max_tokens_limit: int = 0) -> str | None:
    """generate's sampling flags outside the bounds the API holds requests to (the same LIMITS,
    max_tokens_limit when set, and check_fields for the stop strings), or None."""
    from server.engine.types import LIMITS, check_fields

    if max_tokens_limit and (args.max_tokens or 0) > max_tokens_limit:  # as the API refuses it
        return f"--max-tokens {args.max_tokens}: above the limit of {max_tokens_limit} tokens (RWKV_MAX_TOKENS_LIMIT)"

    for name in GENERATE_FIELDS:
        value = getattr(args, name)
        if value is None:  # --seed not given: a random one; --max-tokens: its default
            continue
        flag, (lo, hi) = f"--{name.replace('_', '-')} {value}", LIMITS[name]
        if not math.isfinite(value):
            return f"{flag}: must be a finite number"
        if not lo <= value <= hi:
            return f"{flag}: must be {_bound(lo)} to {_bound(hi)} (the API's bounds)"
    try:
        check_fields({"stop": list(args.stop)}, vocab_size=1)
    except ValueError as exc:
        return "--stop: " + str(exc).removeprefix("invalid 'stop': ")
    return None


def prompt_problem(prompt: str, max_prompt_tokens: int) -> str | None:
    """A prompt longer than max_prompt_tokens, as the engine counts it (found before the model loads)."""
    from server.tokenizer import get_tokenizer

    if (n := len(get_tokenizer().encode(prompt))) > max_prompt_tokens:
        return f"the prompt has {n} tokens (max {max_prompt_tokens}; RWKV_MAX_PROMPT_TOKENS)"
    return None


def _bound(x: float) -> str:
    return f"{x:,}" if isinstance(x, int) else f"{x:g}"


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
    empty = "the prompt is empty: nothing to generate from" if not prompt else None
    problem = empty or sampling_problem(args, settings.max_tokens_limit) or settings_problem(settings)
    problem = problem or prompt_problem(prompt, settings.max_prompt_tokens)
    if problem is not None:
        print(f"rwkv-server generate: {problem}", file=sys.stderr)
        return 2
    debug = settings.log_level.lower() == "debug"
    setup_logging("debug" if debug else "warning")
    if not debug:  # an engine error's log line without its traceback (RWKV_LOG_LEVEL=debug shows it)
        logging.getLogger().handlers[0].addFilter(drop_traceback)
    warn_unknown_variables()
    from server.api.loading import load_services
    from server.engine.types import ERROR, EngineError, PromptTooLongError, SamplingParams
    from server.model.checkpoint import CheckpointError

    try:
        sv = load_services(settings)
    except (CheckpointError, OSError, ValueError, KeyError, MemoryError, RuntimeError) as exc:
        # what serve reports in one line too; RuntimeError: torch's, out of memory among them
        logging.getLogger("server.cli").debug("loading failed", exc_info=True)
        print(f"rwkv-server generate: could not load the model: {type(exc).__name__}: {torch_message(exc)}",
              file=sys.stderr)  # fmt: skip
        return 1
    default = min(GENERATE_MAX_TOKENS, settings.max_tokens_limit or GENERATE_MAX_TOKENS)  # as the API's default
    params = SamplingParams(
        max_tokens=default if args.max_tokens is None else args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        stop=tuple(args.stop),
    )
    try:
        t0 = time.perf_counter()
        try:
            h = sv.engine.submit(prompt, params)
        except (ValueError, PromptTooLongError) as exc:  # what the engine refuses: a prompt too long, ...
            print(f"rwkv-server generate: {exc}", file=sys.stderr)
            return 2
        except EngineError as exc:  # (the engine stopped)
            print(f"rwkv-server generate: generation failed: {exc}", file=sys.stderr)
            return 1
        sys.stdout.write(prompt)
        try:
            for ev in h:
                sys.stdout.write(ev.text)
                sys.stdout.flush()
            res = h.result()
        except EngineError as exc:  # the engine stopped
            print(f"\nrwkv-server generate: generation failed: {exc}", file=sys.stderr)
            return 1
        dt = time.perf_counter() - t0
        print(
            f"\n[{res.completion_tokens} tokens, finish {res.finish_reason}, {dt:.2f}s, "
            f"prompt {res.prompt_tokens} tokens]",
            file=sys.stderr,
        )
        if res.finish_reason == ERROR:
            print(f"rwkv-server generate: generation failed: {res.error or 'no reason given'}", file=sys.stderr)
            return 1
    finally:
        sv.engine.shutdown()
    return 0


def drop_traceback(record: logging.LogRecord) -> bool:
    """A log filter: the record's message line only, without its traceback."""
    record.exc_info, record.exc_text, record.stack_info = None, None, None
    return True


if __name__ == "__main__":
    sys.exit(main())
