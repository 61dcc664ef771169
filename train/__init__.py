"""Training: the loop, its engine and layouts, checkpoints, resume and what a run records."""
