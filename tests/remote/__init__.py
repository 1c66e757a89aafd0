"""Remote L3 hosts: the wire, sessions, the remote endpoint and worker service, config,
proxies, end to end."""
