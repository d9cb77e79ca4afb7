"""optimum ONNX export: ``optimum-cli export onnx --task text-generation-with-past`` on a checkpoint,
inspected like the ORT GenAI exports (op counts, checker, strict shape inference, one forward
step, the failing node named), cached by source hash, options and pins.

Names load lazily: the quantizer child runs in the optimum-onnx environment, which may lack pydantic.
"""

import importlib

_WHERE = {"env_spec": "env", "export": "build", "OptimumOnnxOptions": "specs", "OptimumOnnxResult": "specs"}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(name)
    return getattr(importlib.import_module(f"adapters.optimum_onnx_export.{_WHERE[name]}"), name)
