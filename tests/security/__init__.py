"""Who may do what: other clients and users, what task code may run, hardening against
hostile peers."""
