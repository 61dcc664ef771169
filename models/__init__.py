"""Models and what is done with them: builders by name, training (the loop, its engine, checkpoints, resume),
masked-autoencoder pretraining, imports of published checkpoints, evaluation and prediction."""
