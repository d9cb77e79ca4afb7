"""TensorRT-LLM: its LLM API in a worker process, or ``trtllm-serve``, in its own environment."""
