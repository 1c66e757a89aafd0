"""Operating the daemon: check-config, logs, signals, metrics, deploy files, the README
walkthrough, smoke runs."""
