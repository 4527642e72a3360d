"""`ddte serve`: one loaded pair and its policy behind an OpenAI-compatible HTTP API (FastAPI on uvicorn)."""
