"""Training the drafts: batches from the stream, losses, the loop, checkpoints, the stage."""
