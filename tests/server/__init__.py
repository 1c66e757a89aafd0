"""The daemon (simpler-daemon): end to end, errors, fairness, local and remote L3s, memory,
config, metrics, fast path."""
