"""The Scheduler: its tables, fair admission, spin modes, the C SUB pump, lanes and
background progress."""
