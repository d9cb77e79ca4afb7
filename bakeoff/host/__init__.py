"""The machine: processes, engine environments, run directories, redaction, fingerprint, GPU telemetry."""
