"""Load generation: streaming clients, closed-loop sessions, per-request timing, statistics."""
