"""Tests whose point is a fault: killed, stopped or wedged children, daemons and links. All
marked chaos."""
