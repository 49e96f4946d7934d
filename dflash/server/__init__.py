"""The OpenAI-compatible server behind `python -m dflash.serve`: app (routes), protocol (request bodies, errors),
scheduler (the engine thread and its queues), render (responses and stream chunks), parsing (reasoning and tool
calls), metrics (Prometheus), middleware (API key, body limit, access log)."""
