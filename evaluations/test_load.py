"""Load: the engine starts, serves the model and reports what it can (versions, KV capacity)."""

import pytest


@pytest.mark.check("load")
def test_load(engine_state, run):
    check = run.get("load")
    assert check is not None
    if check.status != "pass":
        pytest.fail(f"{check.failure_class}: {check.summary}", pytrace=False)
