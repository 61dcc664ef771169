"""What a model is: the architectures (VideoViT, the masked autoencoder, the zoo of builders by name), their input
transforms, and imports of published checkpoints."""
