"""The OpenVINO environment: optimum-intel's exporter and the OpenVINO GenAI runtime, in one venv.

Pins (found with pip's resolver, 2026-12): openvino, openvino-genai and openvino-tokenizers
release together (the same ``2026.4.1`` triple; openvino-genai pins its openvino-tokenizers);
optimum-intel 2.2.0 requires ``optimum~=2.3.0`` and ``transformers<5.6`` (the known
transformers skew: the ort-genai environment runs 5.19, this one 5.5); ``nncf`` does the
int8/int4 weight compression behind ``--weight-format``. optimum-intel also requires
``torchvision``, which pip takes from the package index, a CUDA build beside the CPU torch:
``import transformers`` model classes then fail ("operator torchvision::nms does not exist",
and the exporter says ``Could not import module 'PreTrainedModel'``). It is uninstalled after
the install; the text-generation export and the runtime do not use it.
The worker needs ``aiohttp`` (``backends._hosting.worker_server``).
"""

from __future__ import annotations

from bakeoff.host import envs

OPENVINO_VERSION = "2026.4.1"
OPTIMUM_INTEL_VERSION = "2.2.0"

REQUIREMENTS = (
    f"openvino=={OPENVINO_VERSION}",
    f"openvino-genai=={OPENVINO_VERSION}.0",
    f"openvino-tokenizers=={OPENVINO_VERSION}.0",
    f"optimum-intel=={OPTIMUM_INTEL_VERSION}",
    "optimum==2.3.0",
    "nncf==3.4.0",
    "torch==2.13.0",
    "transformers>=5.5,<5.6",
    "tokenizers",
    "safetensors",
    "aiohttp",
    "numpy",
)

# what the exporter and the worker import; an interpreter holding all of them is a
# preinstalled openvino environment (bakeoff/host/envs.py)
MODULES = ("openvino", "openvino_genai", "openvino_tokenizers", "optimum.intel", "nncf", "torch", "transformers",
           "tokenizers", "aiohttp", "numpy")


def env_spec() -> envs.EnvSpec:
    """The ``openvino`` environment spec (CPU wheels)."""
    return envs.EnvSpec("openvino", REQUIREMENTS, uninstall=("torchvision",), modules=MODULES,
                        notes=("torchvision uninstalled: the index's CUDA build breaks transformers beside CPU torch",))
