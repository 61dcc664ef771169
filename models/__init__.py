"""Model builders by name: video transformers and torchvision's video models."""
