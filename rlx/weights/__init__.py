"""Weight hand-off from the trainer to everything that generates or scores."""
