"""The transformers reference backend (a worker process running ``generate``)."""
