"""Shipped fixture weights (bakeoff/models/fixtures/shipped.py): every host copies the same files,
checked by sha256; a damaged file is refused by name; a recipe changed without re-shipping, or
``--rebuild``, trains here and says so.

The real shipped folders are used (copied into ``tmp_path`` where a test alters them); nothing
trains: a copy takes about a second.
"""

from __future__ import annotations

import json
import shutil
import time

import pytest

from bakeoff.api.errors import UserError
from bakeoff.models import fixtures
from bakeoff.models.fixtures import shipped

DEFAULT_SUITE = ("tiny-qwen3", "tiny-qwen3-untrained")  # what `make qualify` and the default suite use


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("BAKEOFF_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "fixtures"


@pytest.fixture
def own_shipped(tmp_path, monkeypatch):
    """A private copy of the shipped folders, free to damage."""
    root = tmp_path / "shipped"
    shutil.copytree(shipped.SHIPPED_ROOT, root)
    monkeypatch.setattr(shipped, "SHIPPED_ROOT", root)
    return root


@pytest.mark.parametrize("name", DEFAULT_SUITE)
def test_shipped_for_the_current_recipe(name):
    """A recipe changed without re-shipping its weights would train on every host again (re-ship:
    ``python -m bakeoff.models.fixtures.shipped NAME``)."""
    meta = shipped.manifest(name)
    assert meta is not None, f"no shipped copy of {name}"
    assert meta["recipe_hash"] == fixtures.recipe_hash(name)
    assert meta["fixture_hash"] == shipped.files_hash(meta["files"])
    assert {"model.safetensors", *fixtures.REQUIRED_FILES} <= set(meta["files"])
    for fname, want in meta["files"].items():
        assert shipped.sha256_file(shipped.SHIPPED_ROOT / name / fname) == want["sha256"], fname
    assert meta["built_on"]["cpu_kind"] in ("avx512", "avx2") and meta["built_on"]["versions"]["torch"]


def test_shipped_weights_reach_the_recipe_bar():
    """The record the evaluations pair backends with: what the builder measured on these weights."""
    meta = json.loads((shipped.SHIPPED_ROOT / "tiny-qwen3" / fixtures.MARKER).read_text())
    res, floor = meta["probe_results"], meta["known_answers_floor"]
    assert meta["origin"] == "shipped" and meta["steps"] == meta["recipe"]["train"]["steps"] > 0
    assert all(t["prefix_accuracy"] >= floor for t in res["per_task"].values()), res["per_task"]
    twin = json.loads((shipped.SHIPPED_ROOT / "tiny-qwen3-untrained" / fixtures.MARKER).read_text())
    assert twin["steps"] == 0 and twin["probe_results"]["prefix_accuracy"] < 0.2


def test_build_copies_the_shipped_weights_and_states_their_hash(cache):
    lines: list[str] = []
    t0 = time.monotonic()
    folder = fixtures.build("tiny-qwen3", log=lines.append)
    assert time.monotonic() - t0 < 30, "copied, not trained"
    assert any("copying the shipped weights" in x for x in lines) and not any("building into" in x for x in lines)
    assert lines[-1].startswith("fixture tiny-qwen3: done in") and "sha256 verified" in lines[-1]
    want = shipped.manifest("tiny-qwen3")
    for fname, f in want["files"].items():
        assert shipped.sha256_file(folder / fname) == f["sha256"], fname
    assert json.loads((folder / fixtures.MARKER).read_text())["origin"] == "shipped"
    assert fixtures.is_built("tiny-qwen3")
    facts = fixtures.provenance(folder)
    assert facts["fixture_hash"] == want["fixture_hash"] and facts["origin"] == "shipped"
    assert facts["recipe_hash"] == fixtures.recipe_hash("tiny-qwen3") and facts["trained_on"]["cpu_kind"]


@pytest.mark.parametrize("damage", ["flip a byte", "truncate", "remove"])
def test_a_damaged_shipped_file_is_refused_by_name(cache, own_shipped, damage):
    weights = own_shipped / "tiny-qwen3-untrained" / "model.safetensors"
    if damage == "flip a byte":
        data = bytearray(weights.read_bytes())
        data[len(data) // 2] ^= 0x01
        weights.write_bytes(bytes(data))
    elif damage == "truncate":
        weights.write_bytes(weights.read_bytes()[:-1])
    else:
        weights.unlink()
    with pytest.raises(UserError) as e:
        fixtures.build("tiny-qwen3-untrained", log=lambda s: None)
    msg = str(e.value)
    assert "\n" not in msg and "model.safetensors" in msg and "tiny-qwen3-untrained" in msg
    assert "--rebuild" in msg  # the way out, besides reinstalling
    assert not fixtures.is_built("tiny-qwen3-untrained")
    assert [p.name for p in cache.iterdir() if not p.name.endswith(".lock")] == []  # nothing half-copied


def test_an_altered_manifest_is_refused(cache, own_shipped):
    path = own_shipped / "tiny-qwen3-untrained" / shipped.MANIFEST
    meta = json.loads(path.read_text())
    meta["files"]["model.safetensors"]["sha256"] = "0" * 64  # the table no longer matches its fixture_hash
    path.write_text(json.dumps(meta))
    with pytest.raises(UserError, match="fixture_hash"):
        fixtures.build("tiny-qwen3-untrained", log=lambda s: None)


def test_a_build_from_before_shipping_is_replaced_and_a_rebuild_is_kept(cache):
    """A cache folder trained here because no weights shipped then (or before origins were
    recorded) gives way to the shipped copy; one trained on purpose (``--rebuild``) stays."""
    folder = fixtures.build("tiny-qwen3-untrained", log=lambda s: None)
    marker = folder / fixtures.MARKER
    meta = json.loads(marker.read_text())
    for origin, rebuilt, kept in [(None, None, False), ("trained here", False, False), ("trained here", True, True)]:
        changed = {k: v for k, v in meta.items() if k not in ("origin", "rebuilt")}
        changed.update({k: v for k, v in (("origin", origin), ("rebuilt", rebuilt)) if v is not None})
        marker.write_text(json.dumps(changed))
        # as such a build would have recorded it: its manifest names the marker's bytes (else it is damage)
        man = json.loads((folder / shipped.MANIFEST).read_text())
        man["files"][fixtures.MARKER] = {"sha256": shipped.sha256_file(marker), "bytes": marker.stat().st_size}
        (folder / shipped.MANIFEST).write_text(json.dumps(man))
        assert fixtures.is_built("tiny-qwen3-untrained") is kept, (origin, rebuilt)
        again = fixtures.build("tiny-qwen3-untrained", log=lambda s: None)
        assert json.loads((again / fixtures.MARKER).read_text()).get("origin") == (origin if kept else "shipped")


def test_fixture_list_says_shipped_until_the_first_use_copies_them(cache, capsys):
    """``bakeoff fixture list`` on an empty cache: a fixture whose weights ship is not "not built"
    (its first use copies them in a second); after the copy it is built; one that does not ship
    (trained on first use) stays "not built"."""
    from cli import main as cli_main

    def listed() -> dict[str, str]:
        assert cli_main.main(["fixture", "list"]) == 0
        return dict(line.split("\t") for line in capsys.readouterr().out.splitlines())

    before = listed()
    assert before["tiny-qwen3"] == "shipped (copied on first use)"
    assert before["tiny-qwen3-moe"] == "not built" and not fixtures.ships("tiny-qwen3-moe")
    fixtures.build("tiny-qwen3", log=lambda s: None)
    assert listed()["tiny-qwen3"] == "built"


@pytest.mark.parametrize("damage", ["scramble in place", "truncate", "remove"])
def test_a_damaged_cached_copy_is_named_and_rebuilt_never_loaded(cache, capsys, damage):
    """Cached fixture weights scrambled in place (same size), cut short or removed (issue 36's census:
    transformers ``disqualified`` ``garbage-output`` on scrambled weights, ``load-failure`` on a
    truncated copy, and ``bakeoff fixture list`` said built): the cached copy is checked against its
    manifest on every use; the list says damaged, the next use says so and reinstalls the shipped copy."""
    from cli import main as cli_main

    folder = fixtures.build("tiny-qwen3", log=lambda s: None)
    weights = folder / "model.safetensors"
    good = weights.read_bytes()
    if damage == "scramble in place":
        weights.write_bytes(good[:4096] + bytes(reversed(good[4096:])))
    elif damage == "truncate":
        weights.write_bytes(good[: len(good) // 2])
    else:
        weights.unlink()
    assert fixtures.damage("tiny-qwen3")
    assert cli_main.main(["fixture", "list"]) == 0
    state = dict(line.split("\t") for line in capsys.readouterr().out.splitlines()).get("tiny-qwen3", "")
    if damage != "remove":  # a folder without its weights is not a complete build: listed as shipped
        assert state.startswith("damaged: model.safetensors ") and state.endswith("(rebuilt on next use)"), state
    lines: list[str] = []
    again = fixtures.build("tiny-qwen3", log=lines.append)
    assert again == folder and weights.read_bytes() == good and fixtures.damage("tiny-qwen3") == []
    if damage != "remove":
        assert any("the cached copy in" in x and "is damaged (model.safetensors " in x and "rebuilding it" in x
                   for x in lines), lines
