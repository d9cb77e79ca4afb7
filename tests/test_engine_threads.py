"""The thread count a CPU engine gets in a worker (``backends/_hosting/threads.py``): bakeoff's default
(the usable CPUs less one for the HTTP side and the client) reaches each backend's engine options
unless the user set one, and the run's notes say which it was. No engine runs here; the engines'
own read-back is checked where they run (``tests/test_optimum_ort.py``, ``tests/test_transformers_threads.py``)."""

from __future__ import annotations

import pytest

from backends import resolve
from backends._hosting.threads import default_threads, usable_cpus
from bakeoff.api.specs import BackendConfig


def test_default_leaves_one_cpu_to_the_frontend():
    assert default_threads(2)[0] == 1 and default_threads(16)[0] == 15
    assert default_threads(1)[0] == 1  # never zero
    n, why = default_threads()
    assert n == max(1, usable_cpus() - 1) and f"{usable_cpus()} usable CPUs" in why


def _backend(name: str, tmp_path, **options):
    return resolve(name)(BackendConfig(backend=name, model=str(tmp_path), workdir=str(tmp_path), options=options))


@pytest.mark.parametrize("name, key", [("ort-genai", "intra_op_num_threads"), ("optimum-ort", "intra_op_num_threads"),
                                       ("openvino", "inference_num_threads"), ("transformers", "num_threads")])
def test_unset_threads_get_the_default_and_a_set_value_wins(name, key, tmp_path):
    b = _backend(name, tmp_path)
    assert b.threads() == default_threads()
    b = _backend(name, tmp_path, **{key: 3})
    assert b.threads() == (3, f"{key} option")


def test_the_default_reaches_what_each_engine_is_given(tmp_path):
    want = default_threads()[0]
    assert _backend("openvino", tmp_path).engine_options()["inference_num_threads"] == want
    assert _backend("transformers", tmp_path).worker_options()["num_threads"] == want


def test_other_devices_keep_the_engines_own_default(tmp_path):
    assert _backend("ort-genai", tmp_path, execution_provider="cuda").threads()[0] is None
    assert _backend("optimum-ort", tmp_path, provider="CUDAExecutionProvider").threads()[0] is None
    assert _backend("transformers", tmp_path, device="cuda").threads()[0] is None
