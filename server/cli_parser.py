"""The command line's parser: one `serve` flag per Settings field (its default from the
environment, a bad variable kept as its message: BadEnv), the subcommands' flags, and the
converters of integer flags (byte sizes with suffixes; whole numbers for the rest). Split from
server/cli.py, which runs the commands."""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
from typing import Any, NoReturn, get_type_hints

from server.config import CHOICES, Settings, field_docs, redact_url, whole_number

GENERATE_MAX_TOKENS = 32
"""generate's --max-tokens when none is given (at most RWKV_MAX_TOKENS_LIMIT, when that is set)."""

_SIZE = re.compile(r"^\s*([+-]?[0-9.eE+-]+)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_int(raw: str) -> int:
    """A byte size (the `*_bytes` flags): a whole number, or one with a size suffix: 512MiB,
    2GiB, 1.5G (a fraction of a byte left over is dropped), 2e9. A sign is read (-5 is an
    integer); the ranges are settings_problem's."""
    m = _SIZE.match(raw)
    if not m:
        raise argparse.ArgumentTypeError(f"not a byte size: {raw!r} (a whole number, or with a suffix: 512MiB, 2G)")
    num, unit, _ = m.groups()
    try:
        if not unit:
            return whole_number(num)
        value = float(num) * 1024 ** "_kmgt".index(unit.lower())
        if math.isfinite(value):
            return int(value)
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"not a byte size: {raw!r} (a whole number, or with a suffix: 512MiB, 2G)")


def parse_whole(raw: str) -> int:
    """The other integer flags: a whole number (`2e3` too), no fraction, no suffix."""
    try:
        return whole_number(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {raw!r}") from None


class BadEnv:
    """The default of a setting whose RWKV_* variable cannot be read: its message. --help shows
    it; the command that would use the setting refuses it (bad_environment). Not a str: argparse
    would pass a str default through the flag's type."""

    def __init__(self, message: str) -> None:
        self.message = message

    def __str__(self) -> str:
        return self.message


def bad_environment(values: dict[str, Any]) -> str | None:
    """The line for the first setting still at a BadEnv default (its flag not given), or None."""
    bad = next((v for v in values.values() if isinstance(v, BadEnv)), None)
    return None if bad is None else f"bad environment: {bad}"


def add_settings_flags(p: argparse.ArgumentParser, defaults: Settings, bad_env: dict[str, str] | None = None) -> None:
    """One flag a setting; a field of `bad_env` (its variable cannot be read) defaults to that
    message, as a BadEnv."""
    docs, hints = field_docs(), get_type_hints(Settings)
    for f in dataclasses.fields(Settings):
        flag = "--" + f.name.replace("_", "-")
        default = BadEnv((bad_env or {})[f.name]) if f.name in (bad_env or {}) else getattr(defaults, f.name)
        env = f"RWKV_{f.name.upper()}"
        doc = docs.get(f.name, "").replace("%", "%%")
        typ = hints[f.name]
        if typ is bool:
            p.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=default, help=f"{doc} [env {env}; now: {default}]"
            )
            continue
        if f.name == "log_level":
            conv: Any = str.lower  # DEBUG as debug, as from the environment
        elif typ is int:
            conv = parse_int if f.name.endswith("_bytes") else parse_whole
        else:
            conv = typ
        p.add_argument(
            flag,
            type=conv,
            default=default,
            metavar=f.name.upper(),
            choices=CHOICES.get(f.name),
            help=f"{doc} [env {env}; now: {_shown(f.name, default)}]",
        )


SECRETS = ("api_keys",)
"""Settings --help never shows (people paste its output into tickets): it says whether they are set."""


def _shown(name: str, value: Any) -> str:
    """A setting's current value as --help shows it: secrets hidden, a URL's password as ***,
    byte sizes in GiB / MiB beside the number."""
    if isinstance(value, BadEnv):
        return str(value)
    if name in SECRETS:
        return "(set, not shown)" if value else '""'
    if value == "":
        return '""'
    if isinstance(value, str):
        return redact_url(value)
    if name.endswith("_bytes") and isinstance(value, int) and value >= 1024**2:
        unit, size = ("GiB", 1024**3) if value >= 1024**3 else ("MiB", 1024**2)
        return f"{value} ({value / size:g} {unit})"
    return str(value)


class Parser(argparse.ArgumentParser):
    """argparse's parser, whose errors are one line (serve's usage alone is some 60 lines), and
    which takes no abbreviation of a flag (`--max-tokens` is no `--max-tokens-limit`: a flag of
    another command, or a typo, is refused rather than taken for the flag it begins)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **{**kwargs, "allow_abbrev": False})

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser(defaults: Settings, bad_env: dict[str, str] | None = None) -> argparse.ArgumentParser:
    parser = Parser(
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
    add_settings_flags(serve, defaults, bad_env)
    serve.add_argument(
        "--state",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="load an RWKV-7 state file at start as the public template _NAME (repeatable; added to --states)",
    )
    synth = sub.add_parser("synth", help="write a synthetic checkpoint (random weights) as an official .pth")
    synth.add_argument(
        "preset",
        help="tiny, 0.1b, 0.4b, 1.5b, 2.9b or 7.2b, or a shape L<layers>-C<embd>[-V<vocab>] (C a multiple of "
        "64; V default 65536; e.g. L3-C256-V1024), optionally :seed (e.g. tiny:3; 0 to 2**63-1). A checkpoint "
        "larger than this machine's memory is refused",
    )
    synth.add_argument("out", help="output path, e.g. tiny.pth")
    synth.add_argument(
        "--dtype",
        default="bf16",
        choices=("bf16", "fp16", "fp32"),
        help="tensor dtype in the file (default: %(default)s)",
    )
    qz = sub.add_parser(
        "quantize",
        help="write an 8-bit copy of a checkpoint (later loads skip the quantization; ~60%% of a large model)",
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
    gen.add_argument("--model", default=defaults.model, help="checkpoint .pth or synthetic:<preset>[:seed] "
                     "(default: %(default)r; env RWKV_MODEL; empty: synthetic:tiny)")  # fmt: skip
    gen.add_argument("--device", default=defaults.device, help="torch device: cpu, cuda, cuda:N or auto "
                     "(cuda when available) (default: %(default)s; env RWKV_DEVICE)")  # fmt: skip
    gen.add_argument("--dtype", default=defaults.dtype, choices=CHOICES["dtype"], help="compute dtype; auto: "
                     "fp16 on cuda, fp32 on cpu (default: %(default)s; env RWKV_DTYPE)")  # fmt: skip
    gen.add_argument("--max-tokens", type=int, default=None, metavar="N", help=f"tokens to generate (default: "
                     f"{GENERATE_MAX_TOKENS}, or RWKV_MAX_TOKENS_LIMIT when lower; more is refused)")  # fmt: skip
    gen.add_argument("--temperature", type=float, default=1.0, help="0: greedy (default: %(default)s)")
    gen.add_argument("--top-p", type=float, default=0.3, help="nucleus sampling's mass (default: %(default)s)")
    gen.add_argument("--seed", type=int, default=None, help="the sampling seed (default: a random one)")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    return parser
