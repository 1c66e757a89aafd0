"""Remote L3 workers: the frame codec, the session runner, the parent's endpoint."""
