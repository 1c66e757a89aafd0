"""Child processes: the SUB and chip loops, chip children under a Worker, the local mailbox
endpoint."""
