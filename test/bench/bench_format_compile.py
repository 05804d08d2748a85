"""The first compile of a schema with a string `format` field in a fresh process: CPU seconds of
the engine's GrammarCompiler (the synthetic model's vocabulary, as the tests use it) after one
warm-up compile, for each format named, in turn (a later one reuses the rules an earlier one
built: xgrammar's cache). docs/agents.md ("String formats") holds the figures this printed.

    PYTHONPATH=. python test/bench/bench_format_compile.py hostname email      # as the engine compiles
    PYTHONPATH=. python test/bench/bench_format_compile.py --as-pattern hostname email  # one pattern each
    PYTHONPATH=. python test/bench/bench_format_compile.py email

--as-pattern compiles each format's EXACT_FORMATS pattern as the library's one regex rule (how the
engine compiled `hostname` and `email` before their shared rules, server/engine/formats.py)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from server.engine.grammar import GrammarCompiler, check_schema  # noqa: E402
from server.engine.types import GrammarSpec  # noqa: E402
from server.tokenizer import get_tokenizer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("formats", nargs="+")
    ap.add_argument("--as-pattern", action="store_true", help="compile each format's pattern as one regex rule")
    args = ap.parse_args()
    compiler = GrammarCompiler(get_tokenizer().token_table)
    compiler.compile(GrammarSpec.json_schema({"type": "object", "properties": {"n": {"type": "integer"}}}))
    for i, fmt in enumerate(args.formats):
        schema = {"type": "object", "properties": {f"f{i}": {"type": "string", "format": fmt}}}
        start = time.process_time()
        if args.as_pattern:  # the library's converter straight, as GrammarCompiler did
            compiler._xgr_compiler().compile_json_schema(check_schema(GrammarSpec.json_schema(schema).source),
                                                         any_whitespace=False, strict_mode=True)  # fmt: skip
        else:
            compiler.compile(GrammarSpec.json_schema(schema))
        print(f"{fmt:16} {time.process_time() - start:.3f} s")


if __name__ == "__main__":
    main()
