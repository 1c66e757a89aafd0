"""Child processes: forking, supervision, and the loops that run inside children."""
