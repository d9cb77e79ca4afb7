"""ONNX Runtime GenAI backend (model-builder export + og.Engine/og.Generator worker)."""
