"""Dynamic int8 quantization of an optimum ONNX export, inside the optimum-onnx environment.

``python -m adapters.optimum_onnx_export._quantize EXPORT_DIR`` writes
``model_quantized.onnx`` beside ``model.onnx`` with optimum's ``ORTQuantizer`` and
``AutoQuantizationConfig.avx2(is_static=False, per_channel=False)`` (optimum-onnx 0.1.0,
optimum/onnxruntime/quantization.py and configuration.py).
"""

from __future__ import annotations

import sys


def main() -> None:
    from optimum.onnxruntime import ORTQuantizer
    from optimum.onnxruntime.configuration import AutoQuantizationConfig

    folder = sys.argv[1]
    quantizer = ORTQuantizer.from_pretrained(folder, file_name="model.onnx")
    quantizer.quantize(save_dir=folder, quantization_config=AutoQuantizationConfig.avx2(is_static=False, per_channel=False))


if __name__ == "__main__":
    main()
