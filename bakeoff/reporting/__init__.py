"""Reports and comparisons, recomputed from run directories alone."""
