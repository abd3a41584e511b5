"""Training: building the rank's model and optimizer, the session (checkpoints, logging, evaluation)
and the loop that reads top to bottom."""
