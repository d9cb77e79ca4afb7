"""Worker process: optimum's ``ORTModelForCausalLM`` behind the OpenAI completions API.

Runs in the ``optimum-onnx`` environment as ``python -m backends.optimum_ort.worker --model
EXPORT_DIR --port P --ready-file F --options JSON``: the transformers worker's HTTP side
(:class:`backends.transformers.worker.TransformersProxy`) in front of optimum-ort's engine process
(:mod:`backends.optimum_ort.engine`).
"""

from __future__ import annotations

from backends.transformers.worker import TransformersProxy
from backends._hosting.worker_server import serve


def main() -> None:
    serve(lambda args: TransformersProxy(args.model, args.options, engine_module="backends.optimum_ort.engine"))


if __name__ == "__main__":
    main()
