"""Code that runs in vLLM's front end (the API server or the `LLM` process)."""
