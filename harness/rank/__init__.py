"""The rank side: code that runs inside a worker process (the trainer, its actors, model,
data, checkpoints, torchft glue and the weight transport)."""
