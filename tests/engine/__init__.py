"""The in-process Worker: blocking and async API, orchestrator, run futures, results,
registration, cancel, local L3s."""
