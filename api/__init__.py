"""The API both HTTP servers speak, the orchestrator's and a worker's frontends': the OpenAI,
Anthropic and Responses schemas, request preparation and validation, the error tree, SSE,
tool-call parsing, structured output, admission, body and header limits, the uvicorn plumbing.

Never imports torch, nor the orchestrator or the frontends (``tests/test_layering.py``).
"""
