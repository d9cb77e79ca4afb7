"""Bad input, one row per input (issue 29): the exit code, the single line it prints, and nothing written.

``bakeoff`` runs in-process (``main(argv)``, fast); ``pytest evaluations/`` runs as the user runs it
(a subprocess: exit 4, ``ERROR: ...``). Every row runs with a fresh, empty ``BAKEOFF_CACHE`` and
an ``--artifacts`` folder that must stay absent or empty, and nothing under the test's folder
may change but what the row's set-up made. Placeholders: ``{art}`` the artifacts folder,
``{tmp}`` the test's folder, ``{<kind>}`` a run directory or model folder made by :func:`place`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cli.main import main

REPO = Path(__file__).resolve().parent.parent
LINE = r"^bakeoff(?: [a-z-]+)*: error: "
RUN = {"run_id": "r", "backend": "transformers", "model": "fixture:tiny-qwen3", "options": {}, "profile": "quick"}


def place(tmp: Path, kind: str) -> Path:
    """A run directory or model folder a user (or an attacker) might pass."""
    d = tmp / kind
    if kind == "loop":  # a symbolic link to itself
        d.symlink_to(d)
        return d
    if kind == "empty-texts":  # a calibration file with no text
        d.write_text("\n\n")
        return d
    d.mkdir()
    if kind in ("deep", "fifo", "fifo-run", "dir-verdict", "device", "deep-run", "run", "utf16", "checks-str", "inf-options"):
        (d / "run.json").write_text(json.dumps(RUN))
        (d / "verdict.json").write_text(json.dumps({**RUN, "checks": []}))
    if kind == "deep":
        (d / "verdict.json").write_text("[" * 200_000 + "]" * 200_000)
    elif kind == "deep-run":
        (d / "run.json").write_text('{"a":' * 200_000 + "1" + "}" * 200_000)
    elif kind == "fifo":
        (d / "verdict.json").unlink()
        os.mkfifo(d / "verdict.json")
    elif kind == "fifo-run":
        (d / "run.json").unlink()
        os.mkfifo(d / "run.json")
    elif kind == "dir-verdict":
        (d / "verdict.json").unlink()
        (d / "verdict.json").mkdir()
    elif kind == "device":
        (d / "verdict.json").unlink()
        (d / "verdict.json").symlink_to("/dev/zero")
    elif kind == "utf16":
        (d / "verdict.json").write_bytes(json.dumps({**RUN, "checks": []}).encode("utf-16"))
    elif kind == "checks-str":
        (d / "verdict.json").write_text(json.dumps({**RUN, "checks": "load"}))
    elif kind == "inf-options":
        (d / "run.json").write_text(json.dumps({**RUN, "options": {"gpu_headroom_gib": float("inf")}}))
    elif kind == "model":
        (d / "config.json").write_text(json.dumps({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}))
    elif kind == "badconfig":
        (d / "config.json").write_text("this is not JSON {")
    elif kind == "cfginf":  # JSON's 1e400 reads as inf
        (d / "config.json").write_text('{"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 1e400}')
    elif kind in ("ref-int", "patches-int"):  # a resumable run whose run.json holds a number where text belongs
        bad = {"reference_reason": "--reference-model", "reference_model": 5} if kind == "ref-int" else {"patches": [5]}
        (d / "run.json").write_text(json.dumps({**RUN, **bad}))
        (d / "verdict.json").write_text(json.dumps({**RUN, "checks": []}))
    elif kind == "bigint-opt":  # an option past any float in a resumable run
        (d / "run.json").write_text(json.dumps({**RUN, "options": {"max_batch_size": 10 ** 4000}}))
        (d / "verdict.json").write_text(json.dumps({**RUN, "checks": []}))
    elif kind == "artj":  # an --artifacts folder whose job record is not JSON
        (d / "jobs").mkdir()
        (d / "jobs" / "j1.json").write_text("garbage")
    return d


# (argv, exit code, the line's pattern after "bakeoff[ cmd]: error: ")
BAKEOFF_ROWS = [
    (["qualify", "--resume", ""], 2, r"--resume is empty"),
    (["qualify", "--resume", " "], 2, r"--resume is empty"),
    (["qualify", "--resume", "{deep}"], 2, r"cannot resume .*nests deeper than any JSON bakeoff writes"),
    (["qualify", "--resume", "{deep-run}"], 2, r"cannot resume .*run\.json nests deeper"),
    (["qualify", "--resume", "{fifo}"], 2, r"cannot resume .*verdict\.json is a FIFO, not a regular file"),
    (["qualify", "--resume", "{fifo-run}"], 2, r"cannot resume .*run\.json is a FIFO"),
    (["qualify", "--resume", "{device}"], 2, r"cannot resume .*verdict\.json is a device"),
    (["qualify", "--resume", "{run}", "--profile", "quick"], 2, r"--resume continues a run with its own settings; drop --profile"),
    (["qualify", "--resume", "{run}", "--artifacts", "{art}"], 2, r"drop --artifacts"),
    (["qualify", "--repeats", "1000000000"], 2, r"--repeats must be at least 1 and at most 100"),
    (["qualify", "--repeats", "-1"], 2, r"--repeats must be at least 1"),
    (["qualify", "--repeats", "x"], 2, r"argument --repeats: invalid int value: 'x'; see bakeoff qualify --help"),
    (["qualify", "--backends", "transformers", "--backend-opt", "gpu_headroom_gib=Infinity"], 2,
     r"--backend-opt gpu_headroom_gib='Infinity': Infinity is not a number; pass a finite value"),
    (["qualify", "--backends", "transformers", "--backend-opt", "gpu_headroom_gib=NaN"], 2, r"NaN is not a number"),
    (["qualify", "--backends", "transformers", "--backend-opt", "gpu_headroom_gib=inf"], 2,
     r"bad value for option 'gpu_headroom_gib' of backend transformers: not a finite number"),
    (["qualify", "--backends", "vllm", "--backend-opt", "speculative_config={\"x\": -Infinity}"], 2, r"-Infinity is not a number"),
    (["qualify", "--backends", "vllm", "--matrix", "max_num_seqs=NaN,4"], 2, r"--matrix max_num_seqs='NaN': NaN is not a number"),
    (["qualify", "--backends", "transformers", "--model", "org/.."], 2, r"model path org/\.\. does not exist"),
    (["qualify", "--backends", "transformers", "--model", "a..b/.."], 2, r"model path a\.\.b/\.\. does not exist"),
    (["qualify", "--backends", "transformers", "--model", "org/x.git"], 2, r"does not exist; pass a checkpoint folder, a hub id"),
    (["qualify", "--backends", "transformers", "--model", "{model}", "--artifacts", "{model}/art"], 2,
     r"--artifacts .*/model/art is inside the model folder .*/model; runs are never written into a checkpoint"),
    (["qualify", "--backends", "transformers", "--model", "{model}", "--artifacts", "{model}"], 2, r"is inside the model folder"),
    (["qualify", "--backends", "transformers", "--model", "a\nb"], 2, r"model path a\\nb does not exist"),
    (["qualify", "--backends", "transformers", "--model", "a\x00b"], 2, r"argument 5 holds a NUL character"),
    (["qualify", "--backends", "transformers", "--model", "a\udcffb"], 2, r"argument 5 \(a\\udcffb\) is not valid UTF-8"),
    (["qualify", "--backends", "transformers", "--report", "a\nb"], 2, r"--report 'a\\nb' is not a plain name"),
    (["qualify", "--backends", "transformers", "--report", ""], 2, r"--report '' is not a plain name"),
    (["qualify", "--backends", "transformers", "--report", "a\\b"], 2, r"is not a plain name"),
    (["qualify", "--backends", "transformers", "--profile", ""], 2, r"unknown profile ''"),
    (["qualify", "--backends", "transformers", "--reference-model", ""], 2, r"--reference-model is empty"),
    (["qualify", "--backends", "transformers", "--artifacts", ""], 2, r"--artifacts is empty"),
    (["qualify", "--backends", "transformers", "--fail-on", ""], 2, r"--fail-on '' is not a verdict status"),
    (["qualify", "--backends", "transformers", "--backend-opt", "vllm:max_model_len=1"], 2,
     r"names backend 'vllm', which is not among --backends transformers"),
    (["qualify", "--backends", "transformers", "--frobnicate"], 2,
     r"unrecognized arguments: --frobnicate; see bakeoff qualify --help"),
    (["qualify", "--backends", "transformers", "--start-timeout", "5"], 2, r"unrecognized arguments: --start-timeout"),
    (["compare", "{deep}", "--artifacts", "{art}"], 2, r"cannot read run directory .*nests deeper"),
    (["compare", "{fifo}", "--artifacts", "{art}"], 2, r"cannot read run directory .*verdict\.json is a FIFO"),
    (["compare", "{dir-verdict}", "--artifacts", "{art}"], 2, r"verdict\.json is a folder, not a regular file"),
    (["compare", "{device}", "--artifacts", "{art}"], 2, r"verdict\.json is a device"),
    (["report", "{deep}", "--artifacts", "{art}"], 2, r"cannot read run directory .*nests deeper"),
    (["report", "{fifo}", "--artifacts", "{art}"], 2, r"verdict\.json is a FIFO"),
    (["compare", "{run}", "--baseline", "", "--artifacts", "{art}"], 2, r"--baseline is empty"),
    (["compare", "{run}", "--artifacts", ""], 2, r"--artifacts is empty"),
    (["compare", "{run}", "--name", "a\tb", "--artifacts", "{art}"], 2, r"--name 'a\\tb' is not a plain name"),
    (["compare"], 2, r"the following arguments are required: runs; see bakeoff compare --help"),
    (["calibrate"], 2, r"the following arguments are required: --concurrency; see bakeoff calibrate --help"),
    (["calibrate", "--concurrency", "1", "--frob"], 2, r"unrecognized arguments: --frob; see bakeoff calibrate --help"),
    (["calibrate", "--concurrency", "1,,2"], 2, r"--concurrency '1,,2' has an empty level"),
    (["calibrate", "--concurrency", ","], 2, r"has an empty level"),
    (["calibrate", "--concurrency", "1000000"], 2, r"at most 100,000"),
    (["calibrate", "--concurrency", "1", "--ttft-ms", "nan"], 2, r"--ttft-ms must be a number of milliseconds from 0 to 60,000, got nan"),
    (["calibrate", "--concurrency", "1", "--ttft-ms", "-50"], 2, r"--ttft-ms must be .* got -50"),
    (["calibrate", "--concurrency", "1", "--itl-ms", "1e9"], 2, r"--itl-ms must be a number of milliseconds from 0 to 10,000"),
    (["calibrate", "--concurrency", "1", "--itl-ms", "inf"], 2, r"--itl-ms must be"),
    (["calibrate", "--concurrency", "1", "--itl-ms", "9000", "--output-tokens", "1000"], 2, r"each level would stream for"),
    (["calibrate", "--concurrency", "1", "--ttft-budget-ms", "0"], 2, r"--ttft-budget-ms must be"),
    (["calibrate", "--concurrency", "1", "--processes", "0"], 2, r"--processes must be from 1 to 256"),
    (["calibrate", "--concurrency", "1", "--out", "{tmp}"], 2, r"--out '.*' is a folder or empty"),
    (["calibrate", "--concurrency", "1", "--out", ""], 2, r"--out '' is a folder or empty"),
    (["calibrate", "--concurrency", "1", "--out", "{tmp}/no/such/x.json"], 2, r"its folder does not exist"),
    (["quantize", "awq", "--model", "{badconfig}", "--out", "{tmp}/q"], 2,
     r"/badconfig/config\.json is not a checkpoint config \(JSONDecodeError"),
    (["quantize", "awq", "--model", "{model}", "--out", "{tmp}/q", "--num-samples", "1000000000"], 2,
     r"--num-samples must be at least 1 and at most 100,000"),
    (["quantize", "awq", "--model", "{model}", "--out", "{model}/q"], 2, r"--out .*/model/q is inside the checkpoint"),
    (["quantize", "awq", "--model", "{model}", "--out", "{tmp}/q", "--dataset", "{empty-texts}"], 2,
     r"--dataset .* holds no calibration text \(SystemExit: calibration file"),
    (["jobs", "export", "ort-genai", "--model", "org/m", "--save-script", "", "--dry-run"], 2, r"--save-script '' names no file"),
    (["qualify", "--backends", "vllm", "--backend-opt", "enforce_eager=2"], 2, r"bad value for option 'enforce_eager'"),
    (["quantize", "awq", "--out", "{tmp}/q"], 2, r"the following arguments are required: --model; see bakeoff quantize --help"),
    (["quantize", "gptq", "--model", "{model}", "--out", "{tmp}/q"], 2, r"argument method: invalid choice: 'gptq'"),
    (["fixture", "build", ""], 2, r"unknown fixture ''"),
    (["fixture", "build"], 2, r"name a fixture to build"),
    (["fixture", "frob"], 2, r"argument action: invalid choice: 'frob' .*; see bakeoff fixture --help$"),
    (["frobnicate"], 2, r"invalid choice: 'frobnicate'"),
    (["jobs", "qualify", "--backends", "vllm", "--flavors", "", "--dry-run"], 2, r"--flavors names no flavor"),
    (["jobs", "qualify", "--backends", "vllm,vllm", "--dry-run"], 2, r"--backends names a backend twice"),
    (["jobs", "export", "ort-genai", "--model", 'a/b"""; import os; os.system("id"); """', "--dry-run"], 2,
     r"--model 'a/b\"\"\"; import os; os.system\(\"id\"\); \"\"\"' is not a Hub id"),
    (["jobs", "qualify", "--backends", "vllm", "--model", "org/m", "--reference-model", "a\nb", "--dry-run"], 2,
     r"--reference-model 'a\\nb' is not a Hub id"),
    (["jobs", "export", "ort-genai", "--model", "org/m", "--python", "3.12; id", "--dry-run"], 2, r"--python '3\.12; id'"),
    (["jobs", "export", "ort-genai", "--model", "org/m", "--image", "x y", "--dry-run"], 2, r"--image 'x y'"),
    (["jobs", "export", "ort-genai", "--model", "org/m", "--env", "A B=1", "--dry-run"], 2, r"--env 'A B'"),
    (["jobs", "export", "ort-genai", "--model", "org/m", "--secret", "$(id)", "--dry-run"], 2, r"--secret '\$\(id\)'"),
    (["jobs", "export", "ort-genai", "--model", "org/m", "--label", "k=a\nb", "--dry-run"], 2, r"--label"),
    (["jobs", "export", "ort-genai", "--model", "org/m", "--path-in-repo", "../x", "--dry-run"], 2, r"--path-in-repo '\.\./x'"),
    (["jobs", "export", "ort-genai", "--model", "org/m", "--bakeoff-spec", "git+https://x/y\n# ///", "--dry-run"], 2,
     r"--bakeoff-spec gives .* which is not one requirement"),
    (["jobs", "wait", "j1", "--poll-s", "nan"], 2, r"--poll-s must be a number of seconds"),
    (["jobs", "logs", "j1", "--tail", "0"], 2, r"--tail must be at least 1 line"),
    (["jobs", "export", "ort-genai", "--frob"], 2, r"unrecognized arguments: --frob; see bakeoff jobs export --help"),
    # found by the campaign of new bad inputs (/work/notes/issue29-table.md)
    (["qualify", "--backends", "vllm", "--backend-opt", "max_model_len=true"], 2, r"'max_model_len' of backend vllm: true is not a number"),
    (["compare", "{utf16}", "--artifacts", "{art}"], 2, r"UnicodeDecodeError"),
    (["report", "{utf16}", "--artifacts", "{art}"], 2, r"UnicodeDecodeError"),
    (["jobs", "export", "ort-genai", "--model", "org/m", "--timeout", "1h\n", "--dry-run"], 2, r"timeout '1h\\n'"),
    (["jobs", "export", "ort-genai", "--model", "org/m", "--push-to", "org/..", "--dry-run"], 2, r"--push-to 'org/\.\.'"),
    (["jobs", "qualify", "--backends", "vllm", "--model", "org/m", "--flavors", "cpu-xl,,cpu-xl", "--dry-run"], 2,
     r"has an empty or repeated flavor"),
    (["fixture", "list", "tiny-qwen3"], 2, r"bakeoff fixture list takes no name"),
    # a new user's, 2026-12-05: the pytest entry's flag given to the CLI
    (["qualify", "--backend", "vllm"], 2, r"--backend is the pytest entry's flag .* takes --backends NAME"),
    (["qualify", "--backends", "transformers", "--artifacts", "/proc/1/artifacts"], 2,
     r"artifacts folder /proc/1/artifacts is not writable \(its filesystem makes no folders there.*: /proc/1\)"),
    # found by the census of 2026-12-04 (582 inputs; issue 29's closing note)
    (["qualify", "--backends", "transformers", "--model", "~no-such-user-census/m"], 2, r"a path starts with ~user"),
    (["qualify", "--backends", "transformers", "--report", "x" * 300], 2, r"--report 'x+'\.\.\. is 300 bytes long"),
    (["qualify", "--backends", "transformers", "--artifacts", "{loop}"], 2, r"/loop is a loop of symbolic links"),
    (["qualify", "--backends", "transformers", "--artifacts", "{loop}/x"], 2, r"/loop/x is a loop of symbolic links"),
    (["qualify", "--resume", "{loop}"], 2, r"/loop is a loop of symbolic links"),
    (["qualify", "--backends", "transformers", "--patch", ".".join(["a"] * 5000) + "=1"], 2, r"deeper than 32 keys"),
    (["qualify", "--resume", "{ref-int}"], 2, r"cannot resume .*run\.json or verdict\.json is not bakeoff's"),
    (["qualify", "--resume", "{patches-int}"], 2, r"is not bakeoff's"),
    (["calibrate", "--concurrency", ",".join(["1"] * 5000)], 2, r"--concurrency has 5,000 levels; pass at most 64"),
    (["calibrate", "--concurrency", "1", "--out", "{loop}"], 2, r"/loop is a loop of symbolic links"),
    (["quantize", "awq", "--model", "{cfginf}", "--out", "{tmp}/q"], 2, r"config\.json has hidden_size = inf"),
    (["jobs", "fetch", "j1", "--artifacts", "{artj}"], 2, r"the job record .*j1\.json is not bakeoff's or is damaged"),
    (["qualify", "--backends", "transformers"] + [x for k in ("max_batch_size", "lone_wait_ms", "stream_interval_ms")
                                                   for x in ("--matrix", f"{k}=" + ",".join(map(str, range(1, 101))))], 2,
     r"--matrix makes 1,000,000 cells; pass at most 64"),
    (["quantize", "awq", "--model", "{model}", "--out", ""], 2, r"--out is empty"),
    (["qualify", "--resume", "{bigint-opt}"], 2, r"bad value for option 'max_batch_size' of backend transformers"),
]

# pytest evaluations/ as a user runs it: exit 4 and `ERROR: <line>`
PYTEST_ROWS = [
    (["--backend", "no-such-engine", "--collect-only"], r"unknown backend 'no-such-engine'"),
    (["--resume", ""], r"--resume is empty"),
    (["--resume", "{deep}"], r"cannot resume .*nests deeper"),
    (["--resume", "{fifo}"], r"cannot resume .*FIFO"),
    (["--resume", "{run}", "--profile=quick"], r"drop --profile"),
    (["--repeats", "1000000000"], r"--repeats must be at least 1 and at most 100"),
    (["--start-timeout", "inf"], r"--start-timeout must be a positive number of seconds"),
    (["--memory-limit-gib", "nan"], r"--memory-limit-gib must be a positive number of GiB"),
    (["--backend-opt", "gpu_headroom_gib=Infinity"], r"Infinity is not a number"),
    (["--backend", "transformers", "--model", "{model}", "--artifacts", "{model}/runs"], r"is inside the model folder"),
    (["--resume", "{inf-options}", "--collect-only"], r"'gpu_headroom_gib' of backend transformers: not a finite number"),
    (["--baseline-run", "{checks-str}"], r"--baseline-run .*not a readable run directory \(ValidationError"),
    (["--resume", "{ref-int}", "--collect-only"], r"is not bakeoff's"),
    (["--resume", "{patches-int}", "--collect-only"], r"is not bakeoff's"),
]


def _fill(argv: list[str], tmp: Path, art: Path) -> list[str]:
    out = []
    for a in argv:
        for kind in re.findall(r"\{([a-z0-9-]+)\}", a):
            if kind in ("art", "tmp"):
                continue
            if not (tmp / kind).exists():
                place(tmp, kind)
        out.append(re.sub(r"\{([a-z0-9-]+)\}", lambda m: str(art if m.group(1) == "art" else tmp if m.group(1) == "tmp"
                                                              else tmp / m.group(1)), a))
    return out


def _snapshot(root: Path) -> dict[str, int]:
    """Every path under ``root`` and each file's mtime (a folder's own mtime moves when a write probe,
    made and removed at once, checks it: that leaves nothing)."""
    return {str(p.relative_to(root)): 0 if p.is_dir() and not p.is_symlink() else p.lstat().st_mtime_ns
            for p in root.rglob("*")}


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    c = tmp_path / "cache"
    c.mkdir()
    monkeypatch.setenv("BAKEOFF_CACHE", str(c))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    return c


@pytest.mark.parametrize("argv, code, pattern", BAKEOFF_ROWS, ids=[" ".join(r[0])[:60] for r in BAKEOFF_ROWS])
def test_bakeoff_bad_input(tmp_path, cache, capsys, argv, code, pattern):
    art, work = tmp_path / "art", tmp_path / "work"
    work.mkdir()
    full = _fill(argv, work, art)
    if argv[0] == "qualify" and "--artifacts" not in argv and "--resume" not in argv:
        full += ["--artifacts", str(art)]
    before = _snapshot(work)
    assert main(full) == code
    out, err = capsys.readouterr()
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert re.match(LINE, lines[0]) and re.search(pattern, lines[0]), lines[0]
    assert "Traceback" not in out + err
    assert not art.exists() or not any(art.rglob("*")), sorted(art.rglob("*"))
    assert not any(cache.iterdir()), sorted(cache.rglob("*"))
    assert _snapshot(work) == before  # nothing made, changed or removed beside the inputs


@pytest.mark.parametrize("argv, pattern", PYTEST_ROWS, ids=[" ".join(r[0])[:60] for r in PYTEST_ROWS])
def test_pytest_evaluations_bad_input(tmp_path, cache, argv, pattern):
    art, work = tmp_path / "art", tmp_path / "work"
    work.mkdir()
    full = _fill(argv, work, art)
    if "--artifacts" not in argv and "--resume" not in argv:
        full += ["--artifacts", str(art)]
    before = _snapshot(work)
    proc = subprocess.run([sys.executable, "-m", "pytest", "evaluations/", "-p", "no:cacheprovider", *full],
                          capture_output=True, text=True, cwd=REPO, timeout=120, env={**os.environ, "BAKEOFF_CACHE": str(cache)})
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 4 and len(lines) == 1, proc.stdout[-1500:] + proc.stderr
    assert lines[0].startswith("ERROR: ") and re.search(pattern, lines[0]), lines[0]
    assert "INTERNALERROR" not in proc.stdout + proc.stderr
    assert not art.exists() or not any(art.rglob("*"))
    assert not any(cache.iterdir()) and _snapshot(work) == before
