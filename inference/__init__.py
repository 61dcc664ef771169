"""Inference: evaluation with views, and prediction on video files."""
