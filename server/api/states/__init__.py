"""State files over HTTP: upload (import), list and delete RWKV-7 state templates, export any
task's or template's state (routes), and the state files loaded at start (startup)."""
