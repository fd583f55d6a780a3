"""The job side: code that runs in the controller's process (the job-level recovery
protocol, placement, hosts, recovery phases, a user program's supervision, launch)."""
