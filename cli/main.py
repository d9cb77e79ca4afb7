"""``bakeoff`` command line. Bad input is one line on stderr naming the fix, exit code 2.

Nothing heavy is imported before a command runs: each command imports what it needs, and the
``jobs`` and tool commands are declared by light modules whose handlers are imported by name
(``"module:function"``) only when chosen, so ``bakeoff`` answers bad input fast.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib
import os
import re
import sys
from pathlib import Path

from bakeoff.api.errors import UserError, one_line
from cli.gating import EXIT_BAD_INPUT, EXIT_INTERRUPTED, GATE_STATUSES
from bakeoff.host.procs import sigterm_as_interrupt
from bakeoff.host.redact import redact
from cli.jobs.args import add_jobs_parser
from cli.tools import add_tool_parsers
import backends

REPO = Path(__file__).resolve().parents[1]
CHECKOUT = (REPO / "pyproject.toml").is_file()  # else an installed wheel: REPO is site-packages
DEFAULT_MODEL = "fixture:tiny-qwen3"  # evaluations/inputs.py DEFAULTS (the one table; named here for --help)
DEFAULT_ARTIFACTS = str(REPO / "artifacts") if CHECKOUT else "artifacts"  # installed: under the current folder


class ArgError(UserError):
    """An argument the parser of ``prog`` (``bakeoff qualify``) refused: one line naming its --help."""

    def __init__(self, prog: str, message: str):
        super().__init__(message)
        self.prog = prog


class Parser(argparse.ArgumentParser):
    """argparse, but a refused argument is one line (``bakeoff qualify: error: ...; see bakeoff
    qualify --help``, exit 2), never the usage block."""

    def error(self, message: str) -> None:
        if "ambiguous option: --backend could match" in message:  # the pytest entry's flag, given to the CLI
            message = ("--backend is the pytest entry's flag (pytest evaluations/ --backend NAME); bakeoff qualify takes "
                       "--backends NAME[,NAME...], and --backend-opt [BACKEND:]KEY=VALUE for options")
        raise ArgError(self.prog, message)


def _report_dest(args) -> Path:
    """``artifacts/reports/NAME`` for ``report`` / ``compare``, checked writable (nothing is
    created: the runs are read and checked first, then the report folder is made)."""
    # lazy: keeps `bakeoff --help` fast: this module is on its path (bakeoff.host.artifacts 10 ms)
    from bakeoff.host.artifacts import check_creatable, plain_name

    name = plain_name(args.name, "--name")
    if not args.artifacts.strip():
        raise UserError("--artifacts is empty; pass the folder reports go to (default: artifacts)")
    check_creatable(Path(args.artifacts))
    return check_creatable(Path(args.artifacts) / "reports" / name)


@contextlib.contextmanager
def _io_as_user_error(what: str):
    """An OSError while reading runs or writing ``what`` becomes one line naming the file."""
    try:
        yield
    except OSError as exc:
        raise UserError(f"cannot read the runs or write the {what}: {exc.__class__.__name__}: {exc.strerror or exc} "
                        f"({exc.filename}); pass readable run folders and a writable --artifacts") from None


def cmd_report(args) -> int:
    # lazy: keeps `bakeoff --help` fast: this module is on its path (bakeoff.reporting.report 40 ms); tests patch report.write_report
    from bakeoff.reporting.report import write_report

    paths = [Path(p) for p in args.runs] or [Path(args.artifacts) / "runs"]
    dest = _report_dest(args)
    with _io_as_user_error("report"):
        print(write_report(paths, dest))
    return 0


def cmd_compare(args) -> int:
    # lazy: keeps `bakeoff --help` fast: this module is on its path (bakeoff.reporting.compare 0.2 s)
    from bakeoff.reporting.compare import write_compare

    if args.baseline is not None and not args.baseline.strip():
        raise UserError("--baseline is empty; pass a run id, a column label or a column number (default: the first run)")
    dest = _report_dest(args)
    with _io_as_user_error("comparison"):
        out = write_compare([Path(p) for p in args.runs], dest, args.baseline)
    print(f"{out['markdown']}\n{out['html']}")
    return 0


def cmd_fixture(args) -> int:
    # lazy: keeps `bakeoff --help` fast: this module is on its path (bakeoff.models.fixtures 60 ms)
    from bakeoff.models import fixtures

    if args.action == "list":
        if args.name or args.force:
            raise UserError("bakeoff fixture list takes no name nor --rebuild; to build: bakeoff fixture build NAME")
        for n in fixtures.names():
            hurt = fixtures.damage(n) if fixtures.is_built(n) else None
            state = (f"damaged: {hurt[0]} (rebuilt on next use)" if hurt else "built" if hurt is not None
                     else "shipped (copied on first use)" if fixtures.ships(n) else "not built")
            print(f"{n}\t{state}")
        return 0
    if not args.name:
        raise UserError(f"name a fixture to build: {', '.join(fixtures.names())}")
    for name in args.name:
        if name.removeprefix("fixture:") not in fixtures.names():
            raise UserError(f"unknown fixture {name!r}; choose one of: {', '.join(fixtures.names())}")
    # lazy: keeps `bakeoff --help` fast: this module is on its path (bakeoff.host.artifacts 10 ms)
    from bakeoff.host.artifacts import check_creatable

    if args.force or not all(fixtures.is_built(n.removeprefix("fixture:")) for n in args.name):
        check_creatable(fixtures.cache_root(), "fixture cache", "point BAKEOFF_CACHE at a writable folder")
    for name in args.name:
        print(fixtures.build(name.removeprefix("fixture:"), force=args.force, log=lambda s: print(s, flush=True)))
    return 0


def cmd_envs(args) -> int:
    # lazy: keeps `bakeoff --help` fast: this module is on its path (bakeoff.host.envs 20 ms)
    from bakeoff.host import envs

    root = envs.cache_root() / "envs"
    for p in sorted(root.glob("*")) if root.is_dir() else []:
        if p.is_dir():
            hurt = envs.damage(p) if (p / ".bakeoff-ready").is_file() else "incomplete"
            state = "ready" if hurt is None else hurt if hurt == "incomplete" else f"damaged: {hurt} (made again on next use)"
            print(f"{p.name}\t{state}\t{p}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``bakeoff`` parser. Light: the subcommands' handlers are named ``"module:function"``
    where importing them costs (``jobs``, ``quantize``, ``calibrate``) and imported when chosen."""
    ap = Parser(prog="bakeoff", description="Qualify or disqualify LLM inference backends for a model, "
                "with captured evidence, and measure the ones that qualify.")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    q = sub.add_parser("qualify", help="run the evaluations once per backend, then write a report")
    q.add_argument("--backends", help=f"comma-separated, from: {', '.join(backends.names())} "
                   f"(default: {','.join(backends.DEFAULT_QUALIFY)})")
    q.add_argument("--model", default=None, help=f"checkpoint folder, hub id, fixture:NAME, or a packaged model "
                   f"(smollm2-135m-instruct) (default: {DEFAULT_MODEL})")
    q.add_argument("--backend-opt", action="append", default=[], metavar="[BACKEND:]KEY=VALUE",
                   help="an engine option (repeatable); BACKEND: limits it to one backend, e.g. "
                        "vllm:kv_cache_dtype=fp8 (an unknown key is refused with the backend's valid keys); "
                        "env.NAME=VALUE sets an environment variable of the engine's processes (vllm), "
                        "verified in each of its ranks")
    q.add_argument("--profile", default=None, help="quick (1-8 sessions, default) | full (1-32 sessions)")
    q.add_argument("--artifacts", default=None, help="folder for runs/ and reports/ "
                   "(default: the checkout's artifacts/; installed: ./artifacts)")
    q.add_argument("--report", default=None, help="report name under artifacts/reports/ (default: latest)")
    q.add_argument("--reference-model", default=None, help="the transformers reference's checkpoint "
                   "(default: the model under test, or its unquantized source when known)")
    q.add_argument("--reference-opt", action="append", default=[], metavar="KEY=VALUE",
                   help="option of the transformers reference, e.g. device=cpu")
    q.add_argument("--no-preflight", action="store_true", help="let each engine decide whether it loads the checkpoint")
    q.add_argument("--patch", action="append", default=[], metavar="PATCH",
                   help="run every backend on a recorded, patched copy of the checkpoint (repeatable): "
                        "quantization_config.ignore+=re:.*mtp\\..*, PATH=VALUE, del:PATH; or 'preflight' for the "
                        "patches the pre-flight rules suggest")
    q.add_argument("--matrix", action="append", default=[], metavar="[BACKEND:]KEY=V1,V2",
                   help="run every combination (repeatable): a backend option or a preset "
                        "(speculative=none,ngram,mtp; prefix_cache=on,off); BACKEND: varies that backend only")
    q.add_argument("--repeats", type=int, default=None, help="measure each sweep point R times (noise estimate; "
                   "default 1, at most 100)")
    q.add_argument("--spec-starts", type=int, default=None, help="fresh engine starts that speculative decoding's "
                   "acceptance is measured on (default 3, at most 20; each start is the engine's start time again)")
    q.add_argument("--quiet", action="store_true", help="no live table and no pytest output (each run keeps it "
                   "in pytest.log); only the verdicts at the end")
    q.add_argument("--fail-on", action="append", default=[], metavar="STATUS",
                   help=f"exit 1 when a run's verdict is STATUS (repeatable): {', '.join(GATE_STATUSES)}; "
                        "without it the exit code is 0 whatever the verdicts (docs/concepts/ci-gating.md)")
    q.add_argument("--resume", default=None, metavar="RUN_DIR",
                   help="finish a cut-off run (its verdict says incomplete): completed checks are kept, then the report "
                        "is re-written; the run's own backend, model and options apply")
    q.set_defaults(func="cli.qualify:cmd_qualify")
    c = sub.add_parser("compare", help="compare runs side by side (Markdown + HTML + plots)")
    c.add_argument("runs", nargs="+", help="run directories or folders of them")
    c.add_argument("--baseline", default=None, help="run id, column label or 1-based column number (default: first)")
    c.add_argument("--artifacts", default=DEFAULT_ARTIFACTS)
    c.add_argument("--name", default="compare", help="report name under artifacts/reports/")
    c.set_defaults(func=cmd_compare)
    r = sub.add_parser("report", help="write a Markdown report of run directories")
    r.add_argument("runs", nargs="*", help="run directories or folders of them (default: artifacts/runs)")
    r.add_argument("--artifacts", default=DEFAULT_ARTIFACTS, help="folder holding runs/ and reports/ (default: %(default)s)")
    r.add_argument("--name", default="latest",
                   help="the report's folder under ARTIFACTS/reports/ (default: %(default)s, which qualify rewrites)")
    r.set_defaults(func=cmd_report)
    f = sub.add_parser("fixture", help="build or list bakeoff's fixture models")
    f.add_argument("action", choices=["build", "list"])
    f.add_argument("name", nargs="*")
    f.add_argument("--rebuild", "--force", dest="force", action="store_true",
                   help="train (or derive) it here, even where its weights ship with bakeoff or are cached")
    f.set_defaults(func=cmd_fixture)
    e = sub.add_parser("envs", help="list engine environments")
    e.set_defaults(func=cmd_envs)
    add_jobs_parser(sub)
    add_tool_parsers(sub)
    return ap


def _handler(func):
    """A command's handler: a function, or ``"module:function"`` imported now that it is chosen."""
    if isinstance(func, str):
        module, _, name = func.partition(":")
        return getattr(importlib.import_module(module), name)
    return func


def _subparser(ap: argparse.ArgumentParser, argv: list[str]) -> argparse.ArgumentParser:
    """The deepest subcommand parser ``argv`` names (``bakeoff jobs export``), for its error line."""
    parser = ap
    for word in argv:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs or word not in subs[0].choices:
            break
        parser = subs[0].choices[word]
    return parser


def _check_text(argv: list[str]) -> None:
    """Every argument is text (a byte sequence that is not UTF-8 reaches Python as lone surrogates,
    which no file, script or command line bakeoff writes can hold).

    Raises:
        UserError: naming the argument.
    """
    for i, arg in enumerate(argv):
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError:
            raise UserError(f"argument {i + 1} ({one_line(arg)[:60]}) is not valid UTF-8 text; pass it as UTF-8") from None
        if "\0" in arg:
            raise UserError(f"argument {i + 1} holds a NUL character; remove it")


def path_problem(exc: BaseException) -> str | None:
    """One line for a path the user gave that the system cannot use (pathlib's symlink loop and
    unknown ``~user``, a name too long, a loop of links), or None for any other error."""
    text = str(exc)
    if isinstance(exc, RuntimeError):
        m = re.match(r"Symlink loop from '(.*)'", text)
        if m:
            return f"{m.group(1)} is a loop of symbolic links; pass a real folder or file"
        if "Could not determine home directory" in text:
            return "a path starts with ~user for a user this machine does not know; pass the full path"
        return None
    if exc.errno == errno.ENAMETOOLONG:
        return f"a file name is too long ({str(exc.filename)[:80]}...); pass a shorter name or path"
    if exc.errno == errno.ELOOP:
        return f"{exc.filename} is a loop of symbolic links; pass a real folder or file"
    return None


def _stdout_to_devnull() -> None:
    """After a closed pipe on stdout, what is still buffered goes nowhere (Python's own advice for
    SIGPIPE: otherwise the interpreter's final flush prints a traceback)."""
    with contextlib.suppress(OSError, ValueError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def main(argv: list[str] | None = None) -> int:
    try:
        sigterm_as_interrupt()
        argv = list(sys.argv[1:] if argv is None else argv)
        _check_text(argv)
        ap = build_parser()
        args, extra = ap.parse_known_args(argv)
        if extra:  # named by the subcommand that was given: `bakeoff qualify: error: unrecognized arguments`
            _subparser(ap, argv).error(f"unrecognized arguments: {' '.join(extra)}")
        if not getattr(args, "func", None):
            _subparser(ap, argv).print_help()
            return 0
        rc = _handler(args.func)(args)
        sys.stdout.flush()  # here, where a closed pipe is caught below, not at the interpreter's exit
        return rc
    except UserError as exc:
        if isinstance(exc, ArgError):
            print(f"{exc.prog}: error: {one_line(str(exc))}; see {exc.prog} --help", file=sys.stderr)
        else:
            print(f"bakeoff: error: {one_line(redact(str(exc)))}", file=sys.stderr)  # a secret the user typed too
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("bakeoff: interrupted; runs written so far are kept (`bakeoff qualify --resume RUN_DIR` finishes one)",
              file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `bakeoff envs | head`: the reader has what it wanted; no traceback at exit
        _stdout_to_devnull()
        return 1
    except (OSError, RuntimeError) as exc:
        line = path_problem(exc)
        if line is None:
            raise
        print(f"bakeoff: error: {line}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Exception as exc:  # huggingface_hub's, raised lazily by the jobs commands
        if type(exc).__name__ != "LocalTokenNotFoundError":
            raise
        print("bakeoff: error: no Hugging Face token; log in with `hf auth login` or set HF_TOKEN", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
