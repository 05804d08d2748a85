"""The task protocol (/v1/tasks/*): routes (routes.py), request bodies (schemas.py) and a task's
SSE stream (stream.py)."""
