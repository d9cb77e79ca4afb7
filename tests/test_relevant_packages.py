"""The versions a run's fingerprint records (``evaluations/session.py RELEVANT_PACKAGES``) cover every
package an engine environment pins: a run on OpenVINO or optimum-onnx names their versions too,
so ``bakeoff compare`` can tell two runs of different engine versions apart."""

from __future__ import annotations

import re

import backends
from evaluations.session import RELEVANT_PACKAGES


def test_every_pinned_engine_package_is_in_the_fingerprint():
    missing = {}
    for name in backends.names():
        for spec in backends.resolve(name).env_specs():
            pinned = {re.split(r"[<>=!~ \[;@]", r, maxsplit=1)[0].lower() for r in spec.requirements}
            if pinned - set(RELEVANT_PACKAGES):
                missing[f"{name} ({spec.name})"] = sorted(pinned - set(RELEVANT_PACKAGES))
    assert not missing, f"add to RELEVANT_PACKAGES: {missing}"
    assert {"openvino", "openvino-genai", "openvino-tokenizers", "optimum-intel", "nncf", "optimum-onnx"} <= set(RELEVANT_PACKAGES)
