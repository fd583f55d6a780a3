"""A program of the user's own as the job's replica groups (``[program]`` in a job config): its
groups (``harness.job.program.groups``), their ranks' environment, admission to the quorum,
deaths, progress, unblocking and takeover. Runs in the controller's process."""
