"""The application: ``bakeoff`` commands and jobs. The only part of bakeoff that names backends,
adapters and evaluations."""
