"""The HTTP front door: the Starlette app and its routes, connections under bounds, what a
request must be before any route sees it, /metrics, the server's one error, running under uvicorn."""
