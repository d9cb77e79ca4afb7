"""The docs are built and tested like code.

- The site (``mkdocs.yml``, ``docs/``) builds with warnings as errors: a link to a page or an
  anchor that does not exist, or a page left out of the navigation, fails the build.
- The README stays short (<= 12 KB) and every link in it resolves (files in the repository,
  anchors of its own headings).
- Every shell command the README and the getting-started page show still works as written, in a
  form that runs in seconds (each case says which): ``make`` targets as a dry run (``make -n``,
  which prints the recipe without running it); ``bakeoff`` commands through bakeoff's own argument
  parser (every flag and subcommand must exist: what drifts when the CLI changes), and those naming
  no placeholder also through ``bakeoff qualify``'s own checks of backends, options and matrix
  (:func:`evaluations.inputs.check_request`, nothing run); ``pytest evaluations/`` commands with
  ``--collect-only`` (the plugin checks its options at collection); ``benchmarks/*.py`` with
  ``--help``.
- Each backend page lists every option of that backend's options model.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
COMMAND_PAGES = (README, REPO / "docs" / "getting-started.md")
README_MAX_BYTES = 12 * 1024
# placeholders the docs write for what the reader fills in: such a command is checked by the parser only
PLACEHOLDER = re.compile(r"/path|\bM\b|RUN_[AB]?\b|\bRUN\b|ORG/NAME|ORG-NAME|org-name|\bDIR\b|\bFILE\b|\.\.\.")


def _shell_blocks(text: str) -> list[str]:
    """The commands of every ```sh block: continuation lines joined, comments dropped."""
    out = []
    for block in re.findall(r"```sh\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" # ")[0].split("  #")[0].strip()
            if line and not line.startswith("#"):
                out.append(line)
    return out


def _commands() -> list[tuple[str, str]]:
    return [(page.relative_to(REPO).as_posix(), cmd) for page in COMMAND_PAGES for cmd in _shell_blocks(page.read_text())]


def test_site_builds_with_warnings_as_errors(tmp_path):
    pytest.importorskip("mkdocs", reason="the docs tools are in the test extra: pip install -e '.[test]'")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(REPO / "mkdocs.yml"),
                           "-d", str(tmp_path / "site")], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (tmp_path / "site" / "backends" / "vllm" / "index.html").is_file()


def test_readme_is_short():
    assert len(README.read_bytes()) <= README_MAX_BYTES, f"README.md is {len(README.read_bytes())} bytes: move detail to docs/"


def _slug(heading: str) -> str:
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"\s+", "-", re.sub(r"[^\w\s-]", "", text))


def test_readme_links_resolve():
    text = README.read_text()
    anchors = {_slug(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert links
    for link in links:
        if re.match(r"[a-z]+://", link):
            continue
        path, _, anchor = link.partition("#")
        if path:
            assert (REPO / path).exists(), f"README links to {link}, which is not in the repository"
        else:
            assert anchor in anchors, f"README links to #{anchor}, which is none of its headings"


def test_the_pages_show_commands():
    cmds = _commands()
    assert any(c.startswith("make ") for _, c in cmds) and sum("bakeoff " in c for _, c in cmds) >= 5, cmds


def _bakeoff_argv(cmd: str) -> list[str] | None:
    words = shlex.split(cmd)
    if words and words[0].endswith("bakeoff"):
        return words[1:]
    return None


@pytest.mark.parametrize("page, cmd", _commands(), ids=lambda x: x[:60] if isinstance(x, str) else None)
def test_command_works_as_written(page, cmd):
    words = shlex.split(cmd)
    if words[0] == "make":  # dry run: the target exists and its recipe expands
        proc = subprocess.run(["make", "-n", *words[1:]], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, f"{page}: {cmd}: {proc.stderr[-1000:]}"
        return
    argv = _bakeoff_argv(cmd)
    if argv is not None:
        from cli.main import build_parser

        args, extra = build_parser().parse_known_args(argv)
        assert not extra, f"{page}: {cmd}: unrecognized {extra}"
        if argv[0] == "qualify" and not PLACEHOLDER.search(cmd) and args.resume is None:
            from cli.qualify import _request
            from evaluations.inputs import check_request

            check_request(_request(args))  # backends, options, matrix, model: refused with a UserError
        return
    at = next((i for i, w in enumerate(words[:3]) if w.endswith("pytest")), None)
    if at is not None and ("evaluations/" in words or "--pyargs" in words):
        words = ["fixture:tiny-qwen3" if w == "M" else w for w in words]  # the model placeholder: the bundled fixture
        proc = subprocess.run([sys.executable, "-m", "pytest", *words[at + 1:], "--collect-only", "-q", "-p",
                               "no:cacheprovider"],
                              cwd=REPO, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"{page}: {cmd}: {proc.stdout[-1500:]} {proc.stderr[-1500:]}"
        return
    script = next((w for w in words if w.startswith("benchmarks/") and w.endswith(".py")), None)
    if script is not None:
        proc = subprocess.run([sys.executable, script, "--help"], cwd=REPO, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, f"{page}: {cmd}: {proc.stderr[-1000:]}"
        return
    pytest.skip(f"not a bakeoff, make, pytest or benchmarks command: {cmd}")


BACKEND_PAGES = {"transformers": "transformers", "vllm": "vllm", "ort-genai": "ort-genai", "optimum-ort": "optimum-ort",
                 "openvino": "openvino", "trtllm": "trtllm", "openai": "openai"}


@pytest.mark.parametrize("backend", sorted(BACKEND_PAGES))
def test_backend_page_lists_every_option(backend):
    import backends

    page = (REPO / "docs" / "backends" / f"{BACKEND_PAGES[backend]}.md").read_text()
    options = page[page.index("**Options**"):].split("\n\n")[0]
    named = set(re.findall(r"`([a-z_][a-z0-9_]*)`", options))
    missing = set(backends.resolve(backend).Options.model_fields) - named
    assert not missing, f"docs/backends/{BACKEND_PAGES[backend]}.md does not list {sorted(missing)}"
